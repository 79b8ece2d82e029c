//! What the allocator knows of each stream's progress on the device: the
//! events it recorded there, how far the stream's work is known complete, and
//! how far every other stream has been made to wait for it.
//!
//! A tick is one allocator operation. An event recorded on a stream at tick
//! `t` covers all work enqueued there up to that operation; a block freed at
//! tick `k` is safe for another stream once an event of its stream with
//! `t >= k` has completed, or once that other stream waited on such an event.
//!
//! Events are recorded on demand, never at a free: a free only notes its
//! stream's tick. When a decision needs to know whether a stream's frees
//! are complete (placement scoring a range another stream freed, a wait, a
//! reclaim, a synchronisation) and no event of that stream covers them, one
//! event is recorded there and then ([`Streams::learn`]); it covers every
//! free the stream has made so far. Reuse on the freeing stream itself never
//! records. The trade-off: an event recorded on demand covers all of the
//! stream's work up to the demand, not up to the free, so on a busy stream
//! it completes later than an event recorded at the free would have (a range
//! stays pending longer, and may be waited for where an earlier event would
//! have been found complete); on an idle stream it is complete at once.
//! Measured on the built-in multi-stream workloads: 10 to 15 times fewer
//! events recorded, and at most 1 point of efficiency (see
//! `docs/benchmarks.md`).
//!
//! Costs: events of a stream complete in order, so only the oldest one is
//! ever queried, and at most once per operation. A wait is made at most
//! once per pair of streams for any span of frees; the growth path polls at
//! most `REFRESH_STREAMS` streams, round robin.
//!
//! A poll that only keeps the lists short (the housekeeping poll of a free,
//! the growth path's refresh: [`Poll::IfDue`]) queries nothing until the
//! oldest event's age is twice its age at the last query that found it
//! running, so a running event costs about `log2` of its age in such queries
//! instead of one per free. A poll whose answer a decision uses (placement
//! scoring its candidates, a wait, a synchronisation, an unmap:
//! [`Poll::Now`]) always queries, so every decision is the one an eager poll
//! would give. (Placement polling only when due learns completions later:
//! measured, it cost mixed-vision-language 2 points of efficiency.)
//!
//! Events are reused, as CUDA's and PyTorch's event pools do: an event known
//! complete (by a poll, or by a stream synchronisation) goes to a spare list
//! of at most [`SPARE_EVENTS`] events shared by every stream (beyond it, it
//! is destroyed), and the next record takes a spare and records it again
//! ([`Vmm::event_record_on`]) before creating one. A steady state thus
//! creates and destroys no events. Re-recording is safe: nothing else holds
//! the id once it left its stream's list, and a wait made on its earlier
//! record keeps waiting for that one. Spares are destroyed at the
//! allocator's drop ([`Streams::destroy_events`]).
//!
//! Stream capture (CUDA graphs): before it records an event on a stream,
//! synchronises one or makes one wait, the allocator asks whether the
//! stream is capturing ([`Vmm::stream_is_capturing`], at most once per
//! stream per operation), and under capture makes only the calls legal
//! under relaxed capture mode: no event is recorded on a capturing stream
//! (so none is ever queried that was recorded in a capture), a capturing
//! stream is never synchronised and never waits for an event (its ordering
//! after another stream's work is a synchronisation of that other stream,
//! on the host, instead). Where only such a call would do, the operation
//! fails with [`capturing`]'s typed error. A free asks nothing; placement
//! asks about the streams whose pending frees lie under the block it chose,
//! and passes over a range a capturing stream freed (`Core::under_capture`).
//!
//! A forgotten stream ([`Streams::forget`]: its owner destroys it) keeps its
//! index, as a tombstone whose work is all complete: its handle is never
//! passed to the driver again, and a later stream with the same handle is a
//! new stream.

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;

use quilt_vmm::{EventId, StreamId, Vmm, VmmError};

/// The set bits of a mask, lowest first.
struct BitIter(u64);

impl Iterator for BitIter {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let i = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(i)
    }
}

/// The streams of a mask ([`Streams::in_mask`]): its bits below 63, then,
/// when bit 63 is set, every stream from the 63rd on (they share it).
pub(crate) struct InMask {
    low: BitIter,
    shared: std::ops::Range<u32>,
}

impl Iterator for InMask {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        self.low.next().or_else(|| self.shared.next())
    }
}

/// Log an event call that failed (`what`: the call and its purpose). These
/// calls only spare waits and synchronisations, so their failure is logged,
/// not returned. Cold and out of line, so that the hot paths which make
/// these calls stay small.
#[cold]
#[inline(never)]
fn event_call_failed(what: &str, err: &VmmError) {
    tracing::warn!(error = %err, "{what} failed");
}

/// The error of a call that would act on a capturing stream where only a
/// synchronisation or a wait would do: refused until the capture ends.
pub(crate) fn capturing(call: quilt_vmm::CallKind, stream: StreamId) -> VmmError {
    VmmError::InvalidArgument {
        call,
        argument: "stream",
        value: stream.0,
        rule: "is capturing a CUDA graph: it cannot be synchronised, record events or wait until the capture ends",
    }
}

/// Streams polled on each growth path, round robin.
const REFRESH_STREAMS: usize = 4;

/// A free polls its stream only once this many of the stream's events wait
/// to be known complete: what a free needs to know is learnt by whoever asks
/// (placement, a wait, a reclaim, each polling first), so the free's poll
/// only keeps the list short, and one poll learns of several events.
const POLL_AT_FREE: usize = 4;

/// Most completed events kept for reuse (see the module documentation);
/// beyond it a completed event is destroyed.
const SPARE_EVENTS: usize = 64;

/// Keep the completed event `e` for reuse, or destroy it when
/// [`SPARE_EVENTS`] are kept already.
fn retire(spare: &mut Vec<EventId>, vmm: &dyn Vmm, e: EventId) {
    if spare.len() < SPARE_EVENTS {
        spare.push(e);
    } else if let Err(err) = vmm.event_destroy(e) {
        event_call_failed("destroying a completed event", &err);
    }
}

/// Whether [`Streams::poll`] queries now or only when due (see the module
/// documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Poll {
    /// Query now (at most once per operation): a decision depends on the
    /// answer (placement, a wait, a synchronisation, an unmap).
    Now,
    /// Query only once the oldest event's age has doubled since a query
    /// found it running: the poll only keeps the lists short.
    IfDue,
}

/// One stream's progress.
#[derive(Debug)]
struct StreamState {
    id: StreamId,
    /// Events recorded and not yet known complete, oldest first: (tick, event).
    events: VecDeque<(u64, EventId)>,
    /// Work enqueued up to this tick is known complete.
    done: u64,
    /// The tick of the latest event recorded here or synchronisation of
    /// this stream: `done` and every `waited` of it only ever take such
    /// ticks (see [`Streams::last_mark`]).
    marked: u64,
    /// Tick of the latest free on this stream.
    last_free: u64,
    /// Tick of the last query of the oldest event (at most one per operation).
    polled_at: u64,
    /// A [`Poll::IfDue`] poll before this tick queries nothing: the oldest
    /// event's age at its last query, which found it running, doubled.
    due_at: u64,
    /// `waited[s]`: this stream has waited for stream `s`'s work up to this tick.
    waited: Vec<u64>,
    /// The tick at which [`Streams::capturing`] last asked the driver
    /// (`u64::MAX`: never), and its answer.
    capture_asked_at: u64,
    capturing: bool,
    /// Forgotten ([`Streams::forget`]): a tombstone whose work is all
    /// complete; its handle is never passed to the driver again.
    forgotten: bool,
}

/// Every stream seen, by dense index. See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    index: HashMap<StreamId, u32>,
    states: Vec<StreamState>,
    /// Events recorded over the allocator's life (for tests and reports).
    pub(crate) recorded: u64,
    /// Completed events kept for reuse, at most [`SPARE_EVENTS`] (see the
    /// module documentation).
    spare: Vec<EventId>,
    /// Cross-stream waits made.
    pub(crate) waits: u64,
    /// Stream synchronisations made.
    pub(crate) syncs: u64,
    /// Bumped whenever some stream's work becomes known complete further
    /// (its `done` grows): what is known complete is as it was while this
    /// is unchanged (a gap pruned of its completed hazards at this value
    /// needs no pruning again, see `Tiling::prune_hazards`).
    pub(crate) progress: u64,
    /// The next stream `refresh` polls.
    cursor: usize,
    /// The stream asked for last and its index: most requests name the
    /// stream of the one before, and need no hashing.
    recent: Option<(StreamId, u32)>,
}

impl Streams {
    /// The index of `id`, registering it on first sight; the second value is
    /// true when it is new.
    pub(crate) fn index(&mut self, id: StreamId) -> (u32, bool) {
        if let Some((r, i)) = self.recent {
            if r == id {
                return (i, false);
            }
        }
        if let Some(&i) = self.index.get(&id) {
            self.recent = Some((id, i));
            return (i, false);
        }
        let i = self.states.len() as u32;
        self.index.insert(id, i);
        self.recent = Some((id, i));
        self.states.push(StreamState {
            id,
            events: VecDeque::new(),
            done: 0,
            marked: 0,
            last_free: 0,
            polled_at: 0,
            due_at: 0,
            waited: Vec::new(),
            capture_asked_at: u64::MAX,
            capturing: false,
            forgotten: false,
        });
        (i, true)
    }

    /// The index of `id` if it is known (and not forgotten).
    pub(crate) fn find(&self, id: StreamId) -> Option<u32> {
        self.index.get(&id).copied()
    }

    /// Whether stream `i` is capturing a CUDA graph now: asked of the driver
    /// at most once per operation `tick` (a failed question is logged and
    /// answered yes: nothing is recorded on, waited by or synchronised on a
    /// stream that may be capturing). A forgotten stream never captures.
    pub(crate) fn capturing(&mut self, vmm: &dyn Vmm, i: u32, tick: u64) -> bool {
        let Some(s) = self.states.get_mut(i as usize) else {
            return false;
        };
        if s.forgotten {
            return false;
        }
        if s.capture_asked_at != tick {
            s.capturing = match vmm.stream_is_capturing(s.id) {
                Ok(c) => c,
                Err(err) => {
                    event_call_failed("asking whether a stream is capturing", &err);
                    true
                }
            };
            s.capture_asked_at = tick;
        }
        s.capturing
    }

    /// Forget stream `i` (its owner is destroying it): synchronise it once
    /// (its work, on memory freed or live, is then complete; a capturing
    /// stream is refused and nothing changes), retire its events, and keep
    /// it as a tombstone whose work is all complete, under no id: its
    /// handle is never passed to the driver again, and a later mention of
    /// the same handle registers a new stream.
    pub(crate) fn forget(&mut self, vmm: &dyn Vmm, i: u32, tick: u64) -> Result<(), VmmError> {
        let Some(id) = self.states.get(i as usize).map(|s| s.id) else {
            return Ok(());
        };
        if self.capturing(vmm, i, tick) {
            return Err(capturing(quilt_vmm::CallKind::StreamSynchronize, id));
        }
        vmm.stream_synchronize(id)?;
        self.syncs += 1;
        let Some(s) = self.states.get_mut(i as usize) else {
            return Ok(());
        };
        s.forgotten = true;
        s.done = u64::MAX;
        s.marked = tick;
        self.progress += 1;
        s.due_at = 0;
        let events: Vec<EventId> = s.events.drain(..).map(|(_, e)| e).collect();
        for e in events {
            retire(&mut self.spare, vmm, e);
        }
        self.index.remove(&id);
        if self.recent.is_some_and(|(r, _)| r == id) {
            self.recent = None;
        }
        // Others' waits for it stand for work now complete anyway.
        Ok(())
    }

    /// Whether stream `i` was forgotten.
    pub(crate) fn is_forgotten(&self, i: u32) -> bool {
        self.states.get(i as usize).is_some_and(|s| s.forgotten)
    }

    /// Streams seen so far.
    pub(crate) fn len(&self) -> usize {
        self.states.len()
    }

    /// The stream at index `i`.
    pub(crate) fn id(&self, i: u32) -> StreamId {
        self.states
            .get(i as usize)
            .map(|s| s.id)
            .unwrap_or_default()
    }

    /// The hazard bit of stream `i`: streams past the 63rd share bit 63.
    pub(crate) fn bit(i: u32) -> u64 {
        1 << i.min(63)
    }

    /// The bits of the first `n` streams (see [`Streams::bit`]).
    #[cfg(feature = "invariants")]
    pub(crate) fn mask_of(n: u32) -> u64 {
        match n {
            0 => 0,
            1..=63 => (1u64 << n) - 1,
            _ => u64::MAX,
        }
    }

    /// The indices of the streams in `mask` (borrowing nothing: the caller
    /// may change the streams while it walks them).
    pub(crate) fn in_mask(&self, mask: u64) -> InMask {
        let n = self.states.len() as u32;
        // Bits of streams not seen yet name none.
        let known = if n >= 63 { !(1 << 63) } else { (1u64 << n) - 1 };
        InMask {
            low: BitIter(mask & known),
            shared: if mask & (1 << 63) != 0 { 63..n } else { 0..0 },
        }
    }

    /// The part of stream `i`'s work up to tick `k` that freed memory can
    /// depend on: up to its last free. Work enqueued on a stream after its
    /// last free cannot touch memory it freed (a range freed by several
    /// streams, or a page's hazard, carries the latest free of any of
    /// them, which may be later than this stream's).
    fn relevant(&self, i: u32, k: u64) -> u64 {
        self.states
            .get(i as usize)
            .map_or(0, |s| k.min(s.last_free))
    }

    /// The latest tick at which an event was recorded on a stream in `mask`
    /// or one of them was synchronised (0: never). What is known of a
    /// stream's progress (how far its work is known complete, how far
    /// another stream waited for it) only ever stops at such ticks, so two
    /// frees of the same streams both later than this are told apart by no
    /// decision, now or later: their hazards may be one (see
    /// `Tiling::add_fresh_hazard`).
    pub(crate) fn last_mark(&self, mask: u64) -> u64 {
        self.in_mask(mask)
            .filter_map(|i| self.states.get(i as usize))
            .map(|s| s.marked)
            .max()
            .unwrap_or(0)
    }

    /// True when stream `i`'s work up to tick `k` is known complete.
    pub(crate) fn is_done(&self, i: u32, k: u64) -> bool {
        self.states.get(i as usize).is_none_or(|s| s.done >= k)
    }

    /// True when the part of stream `i`'s work up to tick `k` that memory
    /// it freed can depend on is known complete (for a hazard: never for
    /// live memory, whose work may come after any free).
    pub(crate) fn freed_done(&self, i: u32, k: u64) -> bool {
        self.is_done(i, self.relevant(i, k))
    }

    /// True when [`Streams::freed_done`] holds for every stream in `mask`:
    /// a hazard of theirs up to `k` constrains nothing.
    pub(crate) fn all_freed_done(&self, mask: u64, k: u64) -> bool {
        self.in_mask(mask).all(|s| self.freed_done(s, k))
    }

    /// True when stream `t` already waited for stream `s`'s work up to `k`
    /// (as far as freed memory can depend on it).
    fn has_waited(&self, t: u32, s: u32, k: u64) -> bool {
        self.waited(t, s) >= self.relevant(s, k)
    }

    /// True when stream `t` needs nothing of stream `s`'s work up to `k` (as
    /// far as freed memory can depend on it): `s` is `t`, or that work is
    /// known complete, or `t` already waited for it. Known without a call.
    pub(crate) fn orders_nothing(&self, t: u32, s: u32, k: u64) -> bool {
        s == t || self.freed_done(s, k) || self.has_waited(t, s, k)
    }

    /// Learn whether stream `i`'s oldest events completed (one query at most
    /// per operation `tick`; with [`Poll::IfDue`], none before the oldest
    /// event is due). Completed events are kept for reuse (or destroyed
    /// past [`SPARE_EVENTS`]).
    pub(crate) fn poll(&mut self, vmm: &dyn Vmm, i: u32, tick: u64, when: Poll) {
        let Some(s) = self.states.get_mut(i as usize) else {
            return;
        };
        if s.polled_at == tick || (when == Poll::IfDue && tick < s.due_at) {
            return;
        }
        s.polled_at = tick;
        while let Some(&(t, e)) = s.events.front() {
            match vmm.event_query(e) {
                Ok(true) => {
                    s.events.pop_front();
                    if t > s.done {
                        s.done = t;
                        self.progress += 1;
                    }
                    // The next event was never found running.
                    s.due_at = 0;
                    retire(&mut self.spare, vmm, e);
                }
                Ok(false) => {
                    // Running at age `tick - t`: due again at twice that age.
                    s.due_at = tick.saturating_add(tick - t.min(tick)).max(tick + 1);
                    break;
                }
                Err(err) => {
                    event_call_failed("querying an event", &err);
                    break;
                }
            }
        }
    }

    /// Learn whether the part of stream `i`'s work up to tick `k` that
    /// freed memory can depend on is complete, for a decision that depends
    /// on it (placement, a wait, a reclaim): [`Streams::cover`] it, then
    /// poll the stream. A stream that has caught up then needs no wait.
    pub(crate) fn learn(&mut self, vmm: &dyn Vmm, i: u32, k: u64, tick: u64) {
        if self.freed_done(i, k) {
            return;
        }
        self.cover(vmm, i, self.relevant(i, k), tick);
        self.poll(vmm, i, tick, Poll::Now);
    }

    /// Make sure an event of stream `i` covers its work up to tick `k`:
    /// when none does (frees record nothing), one is recorded now, on demand
    /// (it covers all of the stream's work so far, and may complete later
    /// than an event recorded at the free would have; on an idle stream it
    /// is complete at once). Nothing on a forgotten or capturing stream. A
    /// failed record is only logged: waits and synchronisations do without
    /// events.
    fn cover(&mut self, vmm: &dyn Vmm, i: u32, k: u64, tick: u64) {
        let Some(s) = self.states.get(i as usize) else {
            return;
        };
        let covered = s.events.back().map_or(s.done, |&(t, _)| t);
        if covered >= k || s.forgotten || self.capturing(vmm, i, tick) {
            return;
        }
        if let Err(err) = self.record(vmm, i, tick) {
            event_call_failed("recording an event on demand", &err);
        }
    }

    /// Stream `i` freed a block at `tick`: noted, nothing recorded (events
    /// are recorded on demand, see [`Streams::learn`]); the stream is polled
    /// once [`POLL_AT_FREE`] of its events wait to be known complete, to
    /// keep its list short.
    pub(crate) fn note_free(&mut self, vmm: &dyn Vmm, i: u32, tick: u64) {
        let Some(s) = self.states.get_mut(i as usize) else {
            return;
        };
        s.last_free = tick;
        if s.events.len() >= POLL_AT_FREE {
            self.poll(vmm, i, tick, Poll::IfDue);
        }
    }

    /// Record an event on stream `i` at `tick` and add it to the stream's
    /// list: a spare recorded again if there is one, else a new one. A spare
    /// whose record fails is logged and destroyed (its id may not be live
    /// any more; at worst the destroy fails too and is logged), and a new
    /// event is recorded instead.
    fn record(&mut self, vmm: &dyn Vmm, i: u32, tick: u64) -> Result<EventId, VmmError> {
        let stream = self.id(i);
        if self.is_forgotten(i) || self.capturing(vmm, i, tick) {
            // Never reached for a forgotten stream (its work is all done),
            // and a record on a capturing stream would be a graph node.
            return Err(capturing(quilt_vmm::CallKind::EventRecord, stream));
        }
        let e = match self.spare.pop() {
            Some(e) => match vmm.event_record_on(e, stream) {
                Ok(()) => e,
                Err(err) => {
                    event_call_failed("recording a spare event again", &err);
                    if let Err(err) = vmm.event_destroy(e) {
                        event_call_failed("destroying a spare event", &err);
                    }
                    vmm.event_record(stream)?
                }
            },
            None => vmm.event_record(stream)?,
        };
        if let Some(s) = self.states.get_mut(i as usize) {
            s.events.push_back((tick, e));
            s.marked = tick;
        }
        self.recorded += 1;
        Ok(e)
    }

    /// On the growth path (a driver call follows anyway): learn the progress
    /// of up to `REFRESH_STREAMS` streams, round robin, first recording
    /// events where frees are uncovered (so that a device already past them
    /// says so at once).
    pub(crate) fn refresh(&mut self, vmm: &dyn Vmm, tick: u64) {
        let n = self.states.len();
        for _ in 0..n.min(REFRESH_STREAMS) {
            let i = (self.cursor % n) as u32;
            self.cursor = self.cursor.wrapping_add(1);
            let last_free = self.states.get(i as usize).map_or(0, |s| s.last_free);
            self.cover(vmm, i, last_free, tick);
            self.poll(vmm, i, tick, Poll::IfDue);
        }
    }

    /// Order stream `t`'s later work after stream `s`'s work up to tick `k`:
    /// nothing when `s` is `t`, when that work is known complete, or when `t`
    /// already waited past it; else one `cuStreamWaitEvent` on an event of
    /// `s` that covers every free `s` has made so far (its newest event if
    /// that one does, else one recorded now). One wait thus makes all of
    /// `s`'s freed memory safe for `t`, not only the range asked for: the
    /// next block `t` places over any of it needs no wait, so waits stay
    /// rare and placement keeps its best fits instead of avoiding freshly
    /// freed ranges. Returns true when a wait was made.
    pub(crate) fn order_after(
        &mut self,
        vmm: &dyn Vmm,
        t: u32,
        s: u32,
        k: u64,
        tick: u64,
    ) -> Result<bool, VmmError> {
        if self.orders_nothing(t, s, k) {
            return Ok(false);
        }
        self.learn(vmm, s, k, tick);
        if self.freed_done(s, k) {
            return Ok(false);
        }
        if self.capturing(vmm, t, tick) {
            // A capturing stream may not wait for work outside its capture:
            // make that work complete on the host instead (legal under
            // relaxed capture when `s` is not capturing itself).
            self.complete(vmm, s, k, tick)?;
            return Ok(false);
        }
        let Some(st) = self.states.get(s as usize) else {
            return Ok(false);
        };
        // Its newest event if it covers every free of `s`, else one now.
        let cover = st.last_free.max(self.relevant(s, k));
        let (et, e) = match st.events.back().filter(|&&(et, _)| et >= cover) {
            Some(&found) => found,
            None => (tick, self.record(vmm, s, tick)?),
        };
        let waiter = self.id(t);
        vmm.stream_wait_event(waiter, e)?;
        self.waits += 1;
        if let Some(ts) = self.states.get_mut(t as usize) {
            if ts.waited.len() <= s as usize {
                ts.waited.resize(s as usize + 1, 0);
            }
            ts.waited[s as usize] = et;
        }
        Ok(true)
    }

    /// How far stream `t` has waited for stream `s`.
    pub(crate) fn waited(&self, t: u32, s: u32) -> u64 {
        self.states
            .get(t as usize)
            .and_then(|st| st.waited.get(s as usize))
            .copied()
            .unwrap_or(0)
    }

    /// Make stream `i`'s work up to `k` complete: poll, and synchronise the
    /// stream if it is still running. Returns true when it synchronised.
    pub(crate) fn complete(
        &mut self,
        vmm: &dyn Vmm,
        i: u32,
        k: u64,
        tick: u64,
    ) -> Result<bool, VmmError> {
        if self.is_done(i, k) {
            return Ok(false);
        }
        self.cover(vmm, i, k, tick);
        self.poll(vmm, i, tick, Poll::Now);
        if self.is_done(i, k) {
            return Ok(false);
        }
        if self.capturing(vmm, i, tick) {
            return Err(capturing(
                quilt_vmm::CallKind::StreamSynchronize,
                self.id(i),
            ));
        }
        let Some(s) = self.states.get_mut(i as usize) else {
            return Ok(false);
        };
        vmm.stream_synchronize(s.id)?;
        self.syncs += 1;
        s.done = tick;
        s.marked = tick;
        self.progress += 1;
        s.due_at = 0;
        for (_, e) in s.events.drain(..) {
            retire(&mut self.spare, vmm, e);
        }
        Ok(true)
    }

    /// Synchronise every stream known and not forgotten, so that no work
    /// may still use the memory (at the allocator's drop, before anything
    /// is unmapped; a single stream records no events, so pending events
    /// alone cannot tell which streams have work). A capturing stream cannot
    /// be synchronised: it is skipped and logged. Returns how many streams
    /// were synchronised.
    pub(crate) fn synchronize_all(&mut self, vmm: &dyn Vmm, tick: u64) -> usize {
        let mut synced = 0;
        for i in 0..self.states.len() as u32 {
            if self.is_forgotten(i) {
                continue;
            }
            if self.capturing(vmm, i, tick) {
                tracing::warn!(
                    stream = self.id(i).0,
                    "a stream is capturing at the allocator's drop: not synchronised"
                );
                continue;
            }
            match vmm.stream_synchronize(self.id(i)) {
                Ok(()) => {
                    synced += 1;
                    self.syncs += 1;
                }
                Err(err) => event_call_failed("synchronising a stream at drop", &err),
            }
        }
        synced
    }

    /// Destroy every outstanding event and every spare (at the allocator's
    /// drop).
    pub(crate) fn destroy_events(&mut self, vmm: &dyn Vmm) {
        for s in &mut self.states {
            for (_, e) in s.events.drain(..) {
                let _ = vmm.event_destroy(e);
            }
        }
        for e in self.spare.drain(..) {
            let _ = vmm.event_destroy(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_names_the_streams_seen_and_bit_63_every_stream_past_the_62nd() {
        let mut st = Streams::default();
        for id in 0..3 {
            st.index(StreamId(100 + id));
        }
        // Bits of streams not seen yet name none; bit 63 names none either.
        let all: Vec<u32> = st.in_mask(0b1011 | 1 << 63).collect();
        assert_eq!(all, vec![0, 1]);
        for id in 3..66 {
            st.index(StreamId(100 + id));
        }
        let shared: Vec<u32> = st.in_mask(1 | 1 << 62 | 1 << 63).collect();
        assert_eq!(shared, vec![0, 62, 63, 64, 65]);
        assert_eq!(st.in_mask(0).count(), 0);
    }
}
