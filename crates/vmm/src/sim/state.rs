//! The simulated device's state: the shared [`Ledger`] (every rule and the
//! bookkeeping of reservations, handles and mappings) plus what only the
//! simulated device has: its address placement and limit, and streams whose
//! events complete when the device catches up with them: by itself, a fixed
//! number of operations after they were queued (the operation clock and
//! `gpu_lag_ops`), or at once on a synchronisation or when a test says so.
//!
//! Every operation validates all of its arguments before it changes anything,
//! so a failed call leaves the state exactly as it was. O(log n) per call,
//! plus O(k log n) for a call that covers k mappings.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::error::{Result, VmmError};
use crate::events::EventBook;
use crate::leak::LeakReport;
use crate::ledger::{invalid, Ledger};
use crate::share::{
    CreateProps, DeviceCaps, DeviceOrdinal, HandleKind, ShareableHandle, SimShared,
};
use crate::sim::LAG_NEVER;
use crate::types::{CallKind, DevicePtr, EventId, MapRule, MemInfo, PhysHandle, StreamId};

/// Ids of simulated memory, unique in the process (so that a handle exported
/// by one simulated device names the same memory on every other).
static NEXT_MEMORY_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh memory id.
fn next_memory_id() -> u64 {
    NEXT_MEMORY_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// First address handed out by `reserve` (the bump pointer's start).
pub(crate) const VA_BASE: u64 = 0x7f00_0000_0000;

/// A record settles its stream first once this many events are queued there.
const SETTLE_AT_RECORD: usize = 16;

/// Where one stream stands: events recorded and completed so far, the events
/// still queued on the device, and the cross-stream waits not yet satisfied.
///
/// Invariants: `completed <= recorded`; `queued` holds, in increasing order,
/// sequence numbers in `completed + 1 ..= recorded` (not necessarily all of
/// them: an event completed by a catch-up leaves the queue); `waits` is in
/// non-decreasing order of position, every position at most `recorded`.
#[derive(Clone, Debug, Default)]
struct Stream {
    recorded: u64,
    completed: u64,
    /// `(seq, ready)`: event number `seq` reaches the front of the device at
    /// clock `ready` (`None`: never by itself, only by a catch-up).
    queued: VecDeque<(u64, Option<u64>)>,
    /// `(position, stream, seq)`: work on this stream after its `position`th event waits
    /// for event number `seq` of `stream`.
    waits: VecDeque<(u64, StreamId, u64)>,
    /// Whoever drives the device declares this stream's work
    /// ([`State::queue_work`]): its events are markers that complete as soon
    /// as the work queued before them has (at once on an idle stream), where
    /// an undeclared stream counts each event as work of its own, due a lag
    /// after its record (a stream always busy).
    declares_work: bool,
}

/// What [`State::enqueue`] queues on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queued {
    /// Work the program launched ([`State::queue_work`]).
    Work,
    /// An event recorded there.
    Event,
}

/// A live event: the `seq`th event recorded on `stream`, or (`captured`)
/// an event last recorded on `stream` while it was being captured: a node
/// of the graph, not work of the stream (its `seq` is the stream's last
/// record before it and means nothing).
#[derive(Clone, Copy, Debug)]
struct Event {
    stream: StreamId,
    seq: u64,
    captured: bool,
}

/// A `CUresult` of the capture family as the simulated device's error.
fn capture_error(call: CallKind, code: u32, name: &str, text: &str) -> VmmError {
    VmmError::Driver {
        call,
        code,
        name: name.to_owned(),
        text: text.to_owned(),
    }
}

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: the call is not permitted on a
/// capturing stream (a synchronisation); the capture is invalidated.
fn capture_unsupported(call: CallKind) -> VmmError {
    capture_error(
        call,
        900,
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "operation not permitted when stream is capturing",
    )
}

/// `CUDA_ERROR_CAPTURED_EVENT`: the event was last recorded in a capture.
fn captured_event(call: CallKind) -> VmmError {
    capture_error(
        call,
        907,
        "CUDA_ERROR_CAPTURED_EVENT",
        "operation not permitted on an event last recorded in a capturing stream",
    )
}

/// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`: a capturing stream would depend
/// on work outside its capture, or a stream outside would join it.
fn capture_isolation(call: CallKind) -> VmmError {
    capture_error(
        call,
        905,
        "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        "dependency created on uncaptured work in another stream",
    )
}

/// All of the simulated device's state.
#[derive(Debug)]
pub(crate) struct State {
    /// Each handle's payload is the id of the memory behind it (the same
    /// for an exported handle and every import of it).
    pub(super) ledger: Ledger<u64>,
    granularity: u64,
    va_limit: u64,
    next_va: u64,
    streams: FxHashMap<StreamId, Stream>,
    events: EventBook<Event>,
    /// The operation clock ([`State::advance`]).
    clock: u64,
    /// Operations after which work queued on a stream completes by itself.
    gpu_lag_ops: u64,
    /// Streams being captured into a graph, each with whether its capture
    /// was invalidated (by a call not permitted under capture).
    capturing: FxHashMap<StreamId, bool>,
    /// Calls refused because of a capture, over the device's life.
    capture_violations: u64,
}

impl State {
    /// An empty device.
    pub(crate) fn new(granularity: u64, capacity: u64, va_limit: u64, gpu_lag_ops: u64) -> State {
        State {
            ledger: Ledger::new(granularity, capacity),
            granularity,
            va_limit,
            next_va: VA_BASE,
            streams: FxHashMap::default(),
            events: EventBook::default(),
            clock: 0,
            gpu_lag_ops,
            capturing: FxHashMap::default(),
            capture_violations: 0,
        }
    }

    /// Sets the ledger's map rule (before the first map).
    pub(crate) fn set_map_rule(&mut self, rule: MapRule) {
        self.ledger.set_map_rule(rule);
    }

    /// Moves the operation clock `ops` forward (saturating): work queued
    /// `gpu_lag_ops` operations ago or earlier may now complete. Lazy: nothing
    /// is settled here; queries and waits settle the streams they look at.
    pub(crate) fn advance(&mut self, ops: u64) {
        self.clock = self.clock.saturating_add(ops);
    }

    /// The operation clock.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// The lag of work queued from now on (work already queued keeps its time).
    pub(crate) fn set_gpu_lag_ops(&mut self, ops: u64) {
        self.gpu_lag_ops = ops;
    }

    /// Bytes of physical memory held by live handles.
    pub(crate) fn physical_in_use(&self) -> u64 {
        self.ledger.used()
    }

    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.ledger.mapped_bytes()
    }

    /// Bytes of address space reserved.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.ledger.reserved_bytes()
    }

    /// Live handles, reservations and mappings.
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        self.ledger.counts()
    }

    /// A copy between host and `[ptr, ptr + len)`: every byte mapped with
    /// access set (the ledger's rule, as on the host and CUDA backends).
    pub(crate) fn check_copy(&self, ptr: DevicePtr, len: u64) -> Result<()> {
        self.ledger.check_accessible(ptr, len)
    }

    /// `cuMemAddressReserve`: the ledger's rules, then the address-space limit.
    /// Addresses come from a bump pointer, never reused, with one granule of
    /// unreserved gap after each reservation so no two are ever adjacent.
    pub(crate) fn reserve(&mut self, size: u64, alignment: u64) -> Result<DevicePtr> {
        let (va_limit, granularity, next_va) = (self.va_limit, self.granularity, &mut self.next_va);
        let available = va_limit.saturating_sub(self.ledger.reserved_bytes());
        self.ledger.reserve(size, alignment, |alignment| {
            let oom = || VmmError::AddressSpaceExhausted {
                call: CallKind::Reserve,
                requested: size,
                available,
            };
            if size > available {
                return Err(oom());
            }
            let Some(ptr) = next_va.checked_next_multiple_of(alignment) else {
                return Err(oom());
            };
            let Some(next) = ptr
                .checked_add(size)
                .and_then(|end| end.checked_add(granularity))
            else {
                return Err(oom());
            };
            *next_va = next;
            Ok(ptr)
        })
    }

    /// What the device supports for sharing.
    pub(crate) fn caps(&self) -> DeviceCaps {
        self.ledger.caps()
    }

    /// Sets what the device supports for sharing (at construction).
    pub(crate) fn set_caps(&mut self, caps: DeviceCaps) {
        self.ledger.set_caps(caps);
    }

    /// `cuMemCreate` (plain with the default properties): new memory.
    pub(crate) fn create_with(&mut self, size: u64, props: CreateProps) -> Result<PhysHandle> {
        self.ledger.create(size, props, |_| Ok(next_memory_id()))
    }

    /// `cuMemExportToShareableHandle`: the memory's id, size and kind.
    pub(crate) fn export_handle(
        &mut self,
        handle: PhysHandle,
        kind: HandleKind,
    ) -> Result<ShareableHandle> {
        self.ledger.export(handle, kind, |entry| {
            Ok(ShareableHandle::Sim(SimShared {
                id: entry.payload,
                size: entry.size,
                kind,
            }))
        })
    }

    /// `cuMemImportFromShareableHandle`: a new handle to the same memory.
    /// Only a simulated handle of the right size is accepted.
    pub(crate) fn import_handle(
        &mut self,
        shared: &ShareableHandle,
        size: u64,
    ) -> Result<PhysHandle> {
        let call = CallKind::ImportHandle;
        let ShareableHandle::Sim(sim) = shared else {
            return Err(invalid(
                call,
                "osHandle",
                0,
                "is not a handle exported by a simulated device",
            ));
        };
        self.ledger.import(size, sim.kind, || {
            if sim.size != size {
                return Err(invalid(
                    call,
                    "size",
                    size,
                    "differs from the size of the exported memory",
                ));
            }
            Ok(sim.id)
        })
    }

    /// The id of the memory behind a live handle (an import shares its
    /// exporter's), or `None` for a dead handle.
    pub(crate) fn memory_id(&self, handle: PhysHandle) -> Option<u64> {
        self.ledger
            .live_handle(CallKind::Create, handle)
            .ok()
            .map(|e| e.payload)
    }

    /// Devices from which the whole mapping containing `addr` is accessible.
    pub(crate) fn devices_with_access(&self, addr: DevicePtr) -> Option<Vec<DeviceOrdinal>> {
        self.ledger.devices_with_access(addr)
    }

    /// Whether the mapping containing `addr` has had its access set (any part
    /// of it), or `None` when `addr` is not mapped.
    pub(crate) fn access_set(&self, addr: DevicePtr) -> Option<bool> {
        self.ledger
            .mapping_containing(addr)
            .map(|(_, m)| m.access.any())
    }

    /// The handle and offset mapped at `addr`, or `None` when not mapped.
    pub(crate) fn translate(&self, addr: DevicePtr) -> Option<(PhysHandle, u64)> {
        self.ledger
            .mapping_containing(addr)
            .map(|(start, m)| (PhysHandle(m.handle), m.offset + (addr - start)))
    }

    /// The simulated memory behind `addr .. addr + len`, as
    /// `(memory id, offset, length)` pieces in address order (pieces of one
    /// memory that continue each other joined); unmapped parts left out.
    pub(crate) fn memory_pieces(&self, addr: DevicePtr, len: u64) -> Vec<(u64, u64, u64)> {
        let end = addr.saturating_add(len);
        let mut pieces: Vec<(u64, u64, u64)> = Vec::new();
        let mut at = addr;
        while at < end {
            let Some((start, m)) = self.ledger.mapping_containing(at) else {
                at = (at / self.granularity + 1).saturating_mul(self.granularity);
                continue;
            };
            let upto = start.saturating_add(m.size).min(end);
            if let Some(memory) = self.memory_id(PhysHandle(m.handle)) {
                let offset = m.offset + (at - start);
                let len = upto - at;
                match pieces.last_mut() {
                    Some(last) if last.0 == memory && last.1 + last.2 == offset => last.2 += len,
                    _ => pieces.push((memory, offset, len)),
                }
            }
            at = upto;
        }
        pieces
    }

    /// How many items (declared work and events) were queued on `stream`
    /// so far: the position its work has reached on the host.
    pub(crate) fn stream_position(&self, stream: StreamId) -> u64 {
        self.streams.get(&stream).map_or(0, |s| s.recorded)
    }

    /// Whether `stream`'s work up to `position` has completed on the device
    /// (settled at the clock now).
    pub(crate) fn work_complete(&mut self, stream: StreamId, position: u64) -> bool {
        self.settle(stream);
        self.streams
            .get(&stream)
            .is_none_or(|s| s.completed >= position)
    }

    /// Whether work queued on `waiter` from now on runs after `stream`'s
    /// work up to `position`: the same stream, that work completed, or
    /// `waiter` waited for an event of `stream` at or past `position`,
    /// directly or through the waits of the streams it waited for (a wait
    /// orders the waiter's later work after the event, and after whatever
    /// that event's stream waited for before it).
    pub(crate) fn ordered_after(
        &mut self,
        waiter: StreamId,
        stream: StreamId,
        position: u64,
    ) -> bool {
        if waiter == stream || self.work_complete(stream, position) {
            return true;
        }
        // (stream, its work up to this position) whose waits order it.
        let mut stack = vec![(waiter, u64::MAX)];
        let mut seen: Vec<(StreamId, u64)> = Vec::new();
        while let Some((id, before)) = stack.pop() {
            let Some(s) = self.streams.get(&id) else {
                continue;
            };
            // A wait at `at` precedes the stream's items `at + 1` onwards.
            for &(_, other, seq) in s.waits.iter().take_while(|w| w.0 < before) {
                if other == stream && seq >= position {
                    return true;
                }
                if !seen.contains(&(other, seq)) {
                    seen.push((other, seq));
                    stack.push((other, seq));
                }
            }
        }
        false
    }

    /// `cuMemGetInfo`.
    pub(crate) fn mem_info(&self) -> MemInfo {
        self.ledger.mem_info()
    }

    /// When work queued now reaches the front of the device: `clock +
    /// gpu_lag_ops`, or never (`None`) with [`LAG_NEVER`] or on overflow.
    fn ready_time(&self) -> Option<u64> {
        if self.gpu_lag_ops == LAG_NEVER {
            return None;
        }
        self.clock.checked_add(self.gpu_lag_ops)
    }

    /// Record an event on `stream`: it reaches the front of the device at
    /// [`State::ready_time`]. On a capturing stream the record is a node of
    /// the graph (legal): the event is captured, and querying it or waiting
    /// for it outside the capture is refused until it is recorded again
    /// outside a capture.
    pub(crate) fn event_record(&mut self, stream: StreamId) -> EventId {
        let event = self.next_event(stream);
        self.events.record(event)
    }

    /// The event a record on `stream` makes now (see [`State::event_record`]).
    fn next_event(&mut self, stream: StreamId) -> Event {
        if self.capturing.contains_key(&stream) {
            let seq = self.streams.get(&stream).map_or(0, |s| s.recorded);
            return Event {
                stream,
                seq,
                captured: true,
            };
        }
        let seq = self.enqueue(stream, Queued::Event);
        Event {
            stream,
            seq,
            captured: false,
        }
    }

    /// Starts capturing `stream` into a graph (`cuStreamBeginCapture`, any
    /// mode: the simulated device enforces what relaxed mode forbids). An
    /// error if it is capturing already.
    pub(crate) fn begin_capture(&mut self, stream: StreamId) -> Result<()> {
        if self.capturing.contains_key(&stream) {
            return Err(capture_error(
                CallKind::StreamSynchronize,
                900,
                "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                "the stream is already capturing",
            ));
        }
        self.capturing.insert(stream, false);
        Ok(())
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture`): an error if it
    /// was not capturing, or `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` if a
    /// call not permitted under capture invalidated it (the capture ends
    /// either way).
    pub(crate) fn end_capture(&mut self, stream: StreamId) -> Result<()> {
        match self.capturing.remove(&stream) {
            None => Err(capture_error(
                CallKind::StreamSynchronize,
                906,
                "CUDA_ERROR_ILLEGAL_STATE",
                "the stream is not capturing",
            )),
            Some(true) => Err(capture_error(
                CallKind::StreamSynchronize,
                901,
                "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
                "capture sequence invalidated by a prohibited operation",
            )),
            Some(false) => Ok(()),
        }
    }

    /// Whether `stream` is capturing (an invalidated capture, not ended
    /// yet, included).
    pub(crate) fn is_capturing(&self, stream: StreamId) -> bool {
        self.capturing.contains_key(&stream)
    }

    /// Calls refused because of a capture so far.
    pub(crate) fn capture_violations(&self) -> u64 {
        self.capture_violations
    }

    /// A call not permitted under capture was made on `stream` (when it is
    /// capturing): its capture is invalidated; returns `error`.
    fn violation(&mut self, stream: StreamId, error: VmmError) -> VmmError {
        if let Some(invalidated) = self.capturing.get_mut(&stream) {
            *invalidated = true;
        }
        self.capture_violations += 1;
        error
    }

    /// `cuStreamSynchronize`: refused (and the capture invalidated) on a
    /// capturing stream; otherwise [`State::complete_stream`].
    pub(crate) fn stream_synchronize(&mut self, stream: StreamId) -> Result<()> {
        if self.capturing.contains_key(&stream) {
            return Err(self.violation(stream, capture_unsupported(CallKind::StreamSynchronize)));
        }
        self.complete_stream(stream);
        Ok(())
    }

    /// `cuCtxSynchronize`: refused (and every capture invalidated) while a
    /// stream is capturing; otherwise [`State::complete_all`].
    pub(crate) fn device_synchronize(&mut self) -> Result<()> {
        if !self.capturing.is_empty() {
            let streams: Vec<StreamId> = self.capturing.keys().copied().collect();
            let error = capture_unsupported(CallKind::StreamSynchronize);
            for stream in streams {
                let _ = self.violation(stream, error.clone());
            }
            return Err(error);
        }
        self.complete_all();
        Ok(())
    }

    /// Record the live `event` again, on `stream`: it now stands for the
    /// stream's next sequence number, queued as [`State::event_record`]
    /// queues a new one. A waiter already ordered after its earlier record
    /// keeps that order (waits name the stream and sequence number, not the
    /// event). An id that is not live is an error and changes nothing.
    pub(crate) fn event_record_on(&mut self, event: EventId, stream: StreamId) -> Result<()> {
        // Checked before queueing anything, so that a bad id changes nothing.
        self.events.get(CallKind::EventRecord, event)?;
        let recorded = self.next_event(stream);
        let e = self.events.get_mut(CallKind::EventRecord, event)?;
        *e = recorded;
        Ok(())
    }

    /// Work was queued on `stream` now (kernels the program launched there):
    /// it completes [`State::ready_time`] from now, once what the stream
    /// waited on has. From the first call on, the stream's events are
    /// markers that cost no time themselves (see [`Stream::declares_work`]).
    pub(crate) fn queue_work(&mut self, stream: StreamId) {
        if self.capturing.contains_key(&stream) {
            return; // captured work runs when the graph is launched
        }
        self.enqueue(stream, Queued::Work);
    }

    /// Queue the next item of `stream`; returns its sequence number. Work,
    /// and an event on a stream whose work is not declared, is due
    /// [`State::ready_time`] from now; an event on a stream whose work is
    /// declared is due at once (it completes when the work and waits before
    /// it have).
    fn enqueue(&mut self, stream: StreamId, item: Queued) -> u64 {
        let (clock, lag) = (self.clock, self.ready_time());
        let mut s = self.streams.entry(stream).or_default();
        if s.queued.len() >= SETTLE_AT_RECORD {
            // Settling keeps the queue short where nothing queries the
            // stream (amortised O(1)); queries settle it anyway.
            self.settle(stream);
            s = self.streams.entry(stream).or_default();
        }
        s.declares_work |= item == Queued::Work;
        let ready = if item == Queued::Event && s.declares_work {
            Some(clock)
        } else {
            lag
        };
        s.recorded += 1;
        let seq = s.recorded;
        s.queued.push_back((seq, ready));
        seq
    }

    /// Whether `e` has completed (settles its stream first, unless it is
    /// already known complete).
    fn is_complete(&mut self, e: &Event) -> bool {
        if self.known_complete(e) {
            return true;
        }
        self.settle(e.stream);
        self.known_complete(e)
    }

    /// Whether `e`'s stream has completed it, as far as settled.
    fn known_complete(&self, e: &Event) -> bool {
        self.streams
            .get(&e.stream)
            .is_some_and(|s| s.completed >= e.seq)
    }

    /// Completes the events of `root` whose time has come, in stream order: an
    /// event completes once the clock has reached its `ready` time and every
    /// wait before it is on a completed event, which settles the waited-on
    /// stream first (and so on, transitively).
    ///
    /// Each pass visits a stream at most once, and passes repeat while one
    /// completes anything: streams that wait on each other in turn (0 waits
    /// for 2, then 2 for 0, then 0 for 2 again) unblock each other one wait
    /// at a time, so a stream settled earlier in a pass may be able to go
    /// on once a later one has. Amortised O(1) per event and per wait (each
    /// leaves its queue once), plus O(k) per pass for the k streams a
    /// blocked chain of waits visits.
    fn settle(&mut self, root: StreamId) {
        // The common case: `root` alone, never blocked on another stream (no
        // allocation; nothing due returns at once).
        let Some(first) = self.settle_alone(root) else {
            return;
        };
        let mut visited = vec![root, first];
        loop {
            let before = self.completed_of(&visited);
            let mut stack = vec![root];
            let mut seen = vec![root];
            while let Some(&id) = stack.last() {
                match self.settle_alone(id) {
                    Some(other) if !seen.contains(&other) => {
                        seen.push(other);
                        stack.push(other);
                    }
                    _ => {
                        stack.pop();
                    }
                }
            }
            for id in seen {
                if !visited.contains(&id) {
                    visited.push(id);
                }
            }
            if self.completed_of(&visited) == before {
                return;
            }
        }
    }

    /// The sum of the completed sequence numbers of `streams` (grows
    /// whenever one of them completes an event).
    fn completed_of(&self, streams: &[StreamId]) -> u64 {
        streams
            .iter()
            .filter_map(|id| self.streams.get(id))
            .map(|s| s.completed)
            .sum()
    }

    /// Completes the events of stream `id` whose time has come, in order,
    /// until one is not due or waits on an event of another stream not yet
    /// complete: returns that stream (`None` when nothing blocks).
    fn settle_alone(&mut self, id: StreamId) -> Option<StreamId> {
        let clock = self.clock;
        loop {
            // One lookup for every event completed without a wait between.
            let s = self.streams.get_mut(&id)?;
            let (other, other_seq) = loop {
                let &(seq, ready) = s.queued.front()?;
                if ready.is_none_or(|r| r > clock) {
                    return None;
                }
                // A wait at `position` precedes event `position + 1` onwards.
                match s.waits.front() {
                    Some(&(position, other, other_seq)) if position < seq => {
                        break (other, other_seq)
                    }
                    _ => {
                        s.queued.pop_front();
                        s.completed = s.completed.max(seq);
                    }
                }
            };
            let done = self
                .streams
                .get(&other)
                .is_some_and(|o| o.completed >= other_seq);
            if !done {
                return Some(other);
            }
            if let Some(s) = self.streams.get_mut(&id) {
                s.waits.pop_front();
            }
        }
    }

    /// `cuEventQuery`.
    /// An event last recorded in a capture is refused
    /// (`CUDA_ERROR_CAPTURED_EVENT`, illegal even under relaxed capture),
    /// and invalidates the capture if it is still under way.
    pub(crate) fn event_query(&mut self, event: EventId) -> Result<bool> {
        let e = *self.events.get(CallKind::EventQuery, event)?;
        if e.captured {
            return Err(self.violation(e.stream, captured_event(CallKind::EventQuery)));
        }
        Ok(self.is_complete(&e))
    }

    /// `cuEventDestroy`.
    pub(crate) fn event_destroy(&mut self, event: EventId) -> Result<()> {
        self.events.remove(CallKind::EventDestroy, event).map(drop)
    }

    /// `cuStreamWaitEvent`: later work on `stream` is ordered after `event`.
    /// Refused where capture is concerned unless both sides belong to it:
    /// a capturing stream waiting for uncaptured work, or a stream outside
    /// the capture waiting for a captured event (it would join the
    /// capture), is `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` and invalidates
    /// the capture (the simulated device is strict where CUDA's rules for
    /// external events depend on flags an allocator does not use).
    pub(crate) fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<()> {
        let e = *self.events.get(CallKind::StreamWaitEvent, event)?;
        let waiter_captures = self.capturing.contains_key(&stream);
        if waiter_captures != e.captured {
            let captured_stream = if waiter_captures { stream } else { e.stream };
            return Err(self.violation(
                captured_stream,
                capture_isolation(CallKind::StreamWaitEvent),
            ));
        }
        if e.captured {
            return Ok(()); // an edge of the graph: no work of the streams
        }
        if e.stream != stream && !self.is_complete(&e) {
            let s = self.streams.entry(stream).or_default();
            let position = s.recorded;
            s.waits.push_back((position, e.stream, e.seq));
        }
        Ok(())
    }

    /// Complete every event recorded so far on `stream`, and (since the stream
    /// waited for them) every event its waits named, transitively: the device
    /// caught up with `stream` at once (`cuStreamSynchronize`).
    pub(crate) fn complete_stream(&mut self, stream: StreamId) {
        let upto = self.streams.get(&stream).map_or(0, |s| s.recorded);
        let mut work = vec![(stream, upto, true)];
        while let Some((id, seq, all)) = work.pop() {
            let Some(s) = self.streams.get_mut(&id) else {
                continue;
            };
            if seq > s.completed {
                s.completed = seq;
            }
            while s.queued.front().is_some_and(|q| q.0 <= s.completed) {
                s.queued.pop_front();
            }
            // A wait at `position` precedes event `position + 1` onwards; waits
            // are in order of position, so the satisfied ones are a prefix.
            while let Some(&(position, other, other_seq)) = s.waits.front() {
                if !(all || position < seq) {
                    break;
                }
                s.waits.pop_front();
                work.push((other, other_seq, false));
            }
        }
    }

    /// Complete every event on every stream.
    pub(crate) fn complete_all(&mut self) {
        for s in self.streams.values_mut() {
            s.completed = s.recorded;
            s.queued.clear();
            s.waits.clear();
        }
    }

    /// Checks every invariant of the bookkeeping (O(n); for tests): the
    /// ledger's (see [`Ledger::check_invariants`]), then reservations never
    /// adjacent and within `va_limit`, every event on a known stream,
    /// numbered no later than the stream's last record, and every stream's
    /// queue and waits in order.
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        self.ledger.check_invariants()?;
        let mut last_end: Option<u64> = None;
        for (start, size) in self.ledger.reservations() {
            if last_end.is_some_and(|e| e >= start) {
                return Err(format!(
                    "reservation {start:#x} overlaps or touches its predecessor"
                ));
            }
            last_end = Some(start + size);
        }
        if self.ledger.reserved_bytes() > self.va_limit {
            return Err(format!(
                "reserved {} over the limit {}",
                self.ledger.reserved_bytes(),
                self.va_limit
            ));
        }
        for (id, e) in self.events.iter() {
            if e.captured && e.seq == 0 && !self.streams.contains_key(&e.stream) {
                continue; // captured on a stream that never recorded outside a capture
            }
            match self.streams.get(&e.stream) {
                Some(s) if e.seq <= s.recorded && s.completed <= s.recorded => {}
                _ => return Err(format!("event {} on {:?} is out of order", id.0, e.stream)),
            }
        }
        for (id, s) in &self.streams {
            let mut last = s.completed;
            for &(seq, _) in &s.queued {
                if seq <= last || seq > s.recorded {
                    return Err(format!("{id:?}: queued event {seq} is out of order"));
                }
                last = seq;
            }
            let mut last_position = 0;
            for &(position, _, _) in &s.waits {
                if position < last_position || position > s.recorded {
                    return Err(format!("{id:?}: wait at {position} is out of order"));
                }
                last_position = position;
            }
        }
        Ok(())
    }

    /// What is alive now.
    pub(crate) fn leak_report(&self) -> LeakReport {
        LeakReport {
            events: self.events.len(),
            ..self.ledger.leak_report()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const G: u64 = 2 << 20;

    fn with_lag(lag: u64) -> State {
        State::new(G, 1 << 30, 1 << 40, lag)
    }

    #[test]
    fn a_recorded_again_event_is_pending_until_the_device_catches_up() {
        let mut st = with_lag(2);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = st.event_record(s1);
        st.advance(2);
        assert!(st.event_query(a).unwrap());
        // Again on its stream: the new capture, not the completed one.
        st.event_record_on(a, s1).unwrap();
        assert!(!st.event_query(a).unwrap(), "recorded again at 2, lag 2");
        st.advance(1);
        assert!(!st.event_query(a).unwrap());
        st.advance(1);
        assert!(st.event_query(a).unwrap());
        // Again on another stream: that stream's progress decides.
        st.event_record_on(a, s2).unwrap();
        assert!(!st.event_query(a).unwrap());
        st.complete_stream(s1);
        assert!(
            !st.event_query(a).unwrap(),
            "s1 is not the event's stream now"
        );
        st.complete_stream(s2);
        assert!(st.event_query(a).unwrap());
        assert_eq!(st.leak_report().events, 1, "the same event throughout");
        st.check_invariants().unwrap();
    }

    #[test]
    fn a_wait_made_before_a_record_again_keeps_its_capture() {
        let mut st = with_lag(5);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = st.event_record(s1);
        st.stream_wait_event(s2, a).unwrap();
        let b = st.event_record(s2);
        st.advance(5);
        assert!(st.event_query(a).unwrap());
        st.event_record_on(a, s1).unwrap();
        assert!(!st.event_query(a).unwrap(), "recorded again at 5, lag 5");
        // s2's work waited for the first capture only, which completed.
        assert!(st.event_query(b).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn recording_again_an_unknown_or_destroyed_event_fails_and_changes_nothing() {
        let mut st = with_lag(1);
        let s = StreamId(1);
        let a = st.event_record(s);
        let b = st.event_record(s);
        st.event_destroy(b).unwrap();
        let recorded = st.streams[&s].recorded;
        let queued = st.streams[&s].queued.len();
        for bad in [b, EventId(99), EventId(0)] {
            let err = st.event_record_on(bad, s).unwrap_err();
            assert!(
                matches!(
                    err,
                    VmmError::InvalidArgument {
                        call: CallKind::EventRecord,
                        argument: "event",
                        ..
                    }
                ),
                "{err:?}"
            );
            // On a stream never seen, too: nothing is created for it.
            assert!(st.event_record_on(bad, StreamId(9)).is_err());
        }
        assert_eq!(st.streams[&s].recorded, recorded);
        assert_eq!(st.streams[&s].queued.len(), queued);
        assert!(!st.streams.contains_key(&StreamId(9)));
        assert_eq!(st.leak_report().events, 1);
        assert!(st.event_query(b).is_err(), "still destroyed");
        st.advance(1);
        assert!(st.event_query(a).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn work_completes_a_lag_after_it_was_queued() {
        let mut st = with_lag(3);
        let s = StreamId(1);
        let a = st.event_record(s);
        st.advance(1);
        let b = st.event_record(s);
        for _ in 0..2 {
            assert!(!st.event_query(a).unwrap() && !st.event_query(b).unwrap());
            st.advance(1);
        }
        assert_eq!(st.clock(), 3);
        assert!(st.event_query(a).unwrap(), "recorded at 0, lag 3");
        assert!(!st.event_query(b).unwrap(), "recorded at 1");
        st.advance(1);
        assert!(st.event_query(b).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn on_a_stream_whose_work_is_declared_events_wait_only_for_that_work() {
        let mut st = with_lag(3);
        let (s1, s2) = (StreamId(1), StreamId(2));
        st.queue_work(s1);
        st.advance(1);
        // Behind the work queued at 0: due at 3.
        let a = st.event_record(s1);
        st.advance(1);
        assert!(!st.event_query(a).unwrap(), "the work queued at 0 runs");
        st.advance(1);
        assert!(
            st.event_query(a).unwrap(),
            "the work queued at 0 is done at 3"
        );
        // The stream is idle: an event recorded now is complete at once.
        let b = st.event_record(s1);
        assert!(
            st.event_query(b).unwrap(),
            "an idle stream completes at once"
        );
        // A marker after a wait waits for the event waited on.
        st.queue_work(s2);
        let on_s2 = st.event_record(s2);
        st.stream_wait_event(s1, on_s2).unwrap();
        let c = st.event_record(s1);
        assert!(!st.event_query(c).unwrap(), "ordered after s2's work");
        st.advance(3);
        assert!(st.event_query(c).unwrap());
        // A stream never declared keeps counting each event as work.
        let d = st.event_record(StreamId(3));
        assert!(!st.event_query(d).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn a_wait_holds_back_later_work_until_its_event_completes() {
        // s1 runs a long kernel (lag 10 for what it queues now); s2 is quick
        // (lag 1) but waits for s1's event before its second event.
        let mut st = with_lag(10);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = st.event_record(s1);
        st.set_gpu_lag_ops(1);
        let before = st.event_record(s2);
        st.stream_wait_event(s2, a).unwrap();
        let after = st.event_record(s2);
        // s3 waits for s2's later event: held back through s2, transitively.
        let s3 = StreamId(3);
        st.stream_wait_event(s3, after).unwrap();
        let c = st.event_record(s3);
        st.advance(1);
        assert!(st.event_query(before).unwrap(), "queued before the wait");
        for clock in 1..10 {
            assert_eq!(st.clock(), clock);
            assert!(!st.event_query(after).unwrap(), "clock {clock}");
            assert!(!st.event_query(c).unwrap(), "clock {clock}");
            st.check_invariants().unwrap();
            st.advance(1);
        }
        assert!(
            st.event_query(c).unwrap(),
            "a completed at 10, and so did the rest"
        );
        assert!(st.event_query(after).unwrap() && st.event_query(a).unwrap());
        assert!(st.streams.values().all(|s| s.waits.is_empty()));
        st.check_invariants().unwrap();
    }

    #[test]
    fn streams_that_wait_on_each_other_in_turn_complete_in_one_query() {
        // s1 and s2 hand work back and forth (s2 waits for s1, then s1 for
        // s2, and so on), as two streams ordered after each other's frees
        // do; the root of the query is settled first, so each round of the
        // chain unblocks the other stream again.
        let mut st = with_lag(4);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let mut last = st.event_record(s1);
        for _ in 0..6 {
            let a = st.event_record(s1);
            st.stream_wait_event(s2, a).unwrap();
            let b = st.event_record(s2);
            st.stream_wait_event(s1, b).unwrap();
            last = st.event_record(s1);
            st.advance(1);
        }
        assert!(!st.event_query(last).unwrap(), "recorded a lag ago");
        st.advance(4);
        assert!(
            st.event_query(last).unwrap(),
            "every event is due and each wait's event is complete"
        );
        st.check_invariants().unwrap();
    }

    #[test]
    fn a_synchronisation_completes_at_once_what_the_lag_holds() {
        let mut st = with_lag(100);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = st.event_record(s1);
        st.stream_wait_event(s2, a).unwrap();
        let b = st.event_record(s2);
        let other = st.event_record(StreamId(3));
        st.advance(5);
        st.complete_stream(s2);
        assert!(st.event_query(b).unwrap(), "synchronised");
        assert!(st.event_query(a).unwrap(), "s2 waited for it");
        assert!(
            !st.event_query(other).unwrap(),
            "an unrelated stream keeps its lag"
        );
        let later = st.event_record(s1);
        assert!(!st.event_query(later).unwrap(), "queued after the catch-up");
        st.advance(99);
        assert!(st.event_query(other).unwrap() && !st.event_query(later).unwrap());
        st.advance(5);
        assert!(st.event_query(later).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn lag_zero_completes_every_event_as_it_is_recorded() {
        let mut st = with_lag(0);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = st.event_record(s1);
        assert!(st.event_query(a).unwrap());
        st.stream_wait_event(s2, a).unwrap();
        assert!(
            st.streams.values().all(|s| s.waits.is_empty()),
            "nothing to wait for"
        );
        let b = st.event_record(s2);
        assert!(st.event_query(b).unwrap());
        assert_eq!(st.clock(), 0);
        assert!(st.streams.values().all(|s| s.completed == s.recorded));
    }

    #[test]
    fn the_default_lag_never_completes_work_by_itself() {
        let mut st = with_lag(LAG_NEVER);
        let a = st.event_record(StreamId(1));
        st.advance(u64::MAX);
        assert!(!st.event_query(a).unwrap());
        st.complete_all();
        assert!(st.event_query(a).unwrap());
    }

    /// A reference model: completion computed from scratch, by recursion.
    #[derive(Default)]
    struct Reference {
        /// Per stream: `(ready, forced)` of each event, by sequence number - 1.
        events: HashMap<StreamId, Vec<(Option<u64>, bool)>>,
        /// Per stream: `(position, stream, seq)`, every cross-stream wait.
        waits: HashMap<StreamId, Vec<(u64, StreamId, u64)>>,
    }

    impl Reference {
        fn complete(&self, clock: u64, s: StreamId, seq: u64) -> bool {
            let Some(list) = self.events.get(&s) else {
                return false;
            };
            let (ready, forced) = list[seq as usize - 1];
            if forced {
                return true;
            }
            let earlier = seq == 1 || self.complete(clock, s, seq - 1);
            earlier
                && ready.is_some_and(|r| r <= clock)
                && self.waits.get(&s).is_none_or(|w| {
                    w.iter()
                        .filter(|w| w.0 < seq)
                        .all(|&(_, o, oseq)| self.complete(clock, o, oseq))
                })
        }

        fn force(&mut self, s: StreamId, upto: u64, all: bool) {
            if let Some(list) = self.events.get_mut(&s) {
                for e in list.iter_mut().take(upto as usize) {
                    e.1 = true;
                }
            }
            let named: Vec<(u64, StreamId, u64)> = self
                .waits
                .get(&s)
                .map(|w| w.iter().copied().filter(|w| all || w.0 < upto).collect())
                .unwrap_or_default();
            for (_, o, oseq) in named {
                self.force(o, oseq, false);
            }
        }
    }

    #[test]
    fn settling_agrees_with_a_reference_model() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        for round in 0..200 {
            let mut st = with_lag(if round % 10 == 9 { LAG_NEVER } else { next(6) });
            let mut reference = Reference::default();
            let mut live: Vec<(EventId, StreamId, u64)> = Vec::new();
            for step in 0..120 {
                let s = StreamId(next(4));
                match next(10) {
                    0..=2 => {
                        let ready = st.ready_time();
                        let id = st.event_record(s);
                        let list = reference.events.entry(s).or_default();
                        list.push((ready, false));
                        live.push((id, s, list.len() as u64));
                    }
                    3 | 4 if !live.is_empty() => {
                        let (id, es, seq) = live[next(live.len() as u64) as usize];
                        st.stream_wait_event(s, id).unwrap();
                        if es != s {
                            let position = reference.events.get(&s).map_or(0, |l| l.len() as u64);
                            reference
                                .waits
                                .entry(s)
                                .or_default()
                                .push((position, es, seq));
                        }
                    }
                    5 => st.advance(next(3)),
                    6 => {
                        st.complete_stream(s);
                        let upto = reference.events.get(&s).map_or(0, |l| l.len() as u64);
                        reference.force(s, upto, true);
                    }
                    7 => st.set_gpu_lag_ops(next(8)),
                    _ => {}
                }
                // Query in a random order: settling must not depend on it.
                let start = if live.is_empty() {
                    0
                } else {
                    next(live.len() as u64) as usize
                };
                for k in 0..live.len() {
                    let (id, es, seq) = live[(start + k) % live.len()];
                    let want = reference.complete(st.clock, es, seq);
                    assert_eq!(
                        st.event_query(id).unwrap(),
                        want,
                        "round {round}, step {step}, event {id:?} ({es:?} #{seq})"
                    );
                }
                st.check_invariants().unwrap();
            }
        }
    }

    #[test]
    fn catching_up_completes_waited_events_transitively() {
        let mut st = State::new(G, 1 << 30, 1 << 40, LAG_NEVER);
        let (s1, s2, s3) = (StreamId(1), StreamId(2), StreamId(3));
        let a = st.event_record(s1);
        st.stream_wait_event(s2, a).unwrap();
        let b = st.event_record(s2);
        st.stream_wait_event(s3, b).unwrap();
        st.complete_stream(s3);
        assert!(st.event_query(a).unwrap() && st.event_query(b).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn waiting_on_a_completed_event_or_own_stream_records_nothing() {
        let mut st = State::new(G, 1 << 30, 1 << 40, LAG_NEVER);
        let s = StreamId(4);
        let a = st.event_record(s);
        st.stream_wait_event(s, a).unwrap();
        st.complete_stream(s);
        st.stream_wait_event(StreamId(5), a).unwrap();
        assert!(st.streams.values().all(|s| s.waits.is_empty()));
    }

    #[test]
    fn failed_calls_change_nothing() {
        let mut st = State::new(G, 8 * G, 1 << 40, LAG_NEVER);
        let va = st.reserve(4 * G, 0).unwrap();
        let plain = CreateProps::default();
        let h = st.create_with(G, plain).unwrap();
        let ok = || Ok(());
        st.ledger.map(va, G, h, 0, |_| ok()).unwrap();
        let before = st.leak_report();
        assert!(st.ledger.map(va, G, h, G, |_| ok()).is_err());
        assert!(st.ledger.unmap(va, 2 * G, |m| (m.len(), ok())).is_err());
        assert!(st.create_with(8 * G, plain).is_err());
        assert!(st.ledger.address_free(va, 4 * G, ok).is_err());
        assert!(st.ledger.set_access(va + G, G, &[0], ok).is_err());
        assert_eq!(st.leak_report(), before);
        st.check_invariants().unwrap();
        assert_eq!(st.translate(va + 5), Some((h, 5)));
    }
}
