//! What the allocator knows of each stream's progress on the device: the
//! events it recorded there, how far the stream's work is known complete, and
//! how far every other stream has been ordered after it.
//!
//! A tick is one allocator operation. An event recorded on a stream at tick
//! `t` covers all work enqueued there up to that operation; a block freed at
//! tick `k` is safe for another stream once an event of its stream with
//! `t >= k` has completed, or once that other stream is ordered after such
//! an event.
//!
//! **When events are recorded** is the policy's `EventTiming`. By default
//! (`OnDemand`) a free records none (its `hazard` argument to
//! [`Streams::note_free`] is false) and a decision that finds no event
//! covering the work it asks about records one then (see below): few event
//! calls, but an event covering more than the free's work. With `AtFree`,
//! as `cudaMallocAsync` does for its stream-ordered frees, a free made
//! while several streams exist (a solo stream's own included, see
//! `solo.rs`: the hazards built when its run ends carry the frees' ticks)
//! records an event on each of the block's
//! streams at the free's tick ([`Streams::note_free`]), so that
//! the event covers the work up to the free and nothing enqueued after it:
//! it completes when that work does, and a decision about the freed range
//! learns exactly whether that work is complete. No event is recorded where
//! the stream's newest event is of the same tick, where its work is known
//! complete up to the free, or on a capturing stream; a decision that finds
//! no event covering the work it asks about records one then, on demand
//! ([`Streams::learn`], covering the stream's work up to the decision).
//! Reuse on the freeing stream itself never asks. A single stream records
//! nothing.
//!
//! **Learning.** A decision about stream `s`'s work up to tick `k`
//! (placement scoring a range `s` freed, a wait, a reclaim, a
//! synchronisation) queries the earliest event of `s` recorded at or after
//! `k`: events of a stream complete in order, so an event found complete
//! retires every older one without querying them, and one found running
//! tells that every later one is running too, which later questions of the
//! same operation use without a query. So a stream is queried once per
//! operation unless two questions fall on either side of what the first
//! answer told. A free keeps its stream's list short: once the list is
//! twice as long as the last such query left it (and at least
//! [`POLL_AT_FREE`]), it queries the event halfway down, which retires
//! half the list when found complete; so a list stays within about twice
//! the events the device has not reached, at one query per that many
//! frees. The growth path ([`Streams::refresh`]) queries a stream's newest
//! event once due (twice the age of the event a query last found running
//! there), which retires all of them on a stream that has caught up.
//!
//! **Waits.** A reuse by stream `t` of memory `s` freed at `k`, with that
//! work not known complete (after a query) and `t` not ordered after it,
//! makes one `cuStreamWaitEvent` on the earliest event of `s` that covers
//! every free `s` has made so far (the one recorded at its latest free,
//! unless that free recorded none). One wait thus makes all of `s`'s freed
//! memory safe for `t`, not only the range asked for: the next block `t`
//! places over any of it needs no wait, so a reuse waits at most once per
//! stream and later reuses rarely. (Waiting on the earliest event at or
//! after `k` instead holds `t` back for less work, but the next reuse of
//! memory `s` freed later waits again: measured, 896 waits against 352 on
//! `offload-pipeline-4`, 325 against 192 on `offload-pipeline-10`.)
//! Orderings through chains of waits are known: each event keeps its
//! stream's `waited` as of its record (shared, copied only when a wait of
//! that stream changes it), and a stream that waits on it becomes ordered
//! after everything that stream had been ordered after *at the record*, not
//! at the wait: work a stream waited for after the event was recorded does
//! not precede the event.
//!
//! Events are reused, as CUDA's and PyTorch's event pools do: an event known
//! complete (by a query, or by a stream synchronisation) goes to a spare
//! list shared by every stream, and the next record takes a spare and
//! records it again ([`Vmm::event_record_on`]) before creating one. The
//! spare list thus holds at most as many events as were outstanding at once,
//! and a steady state creates and destroys none. Re-recording is safe:
//! nothing else holds the id once it left its stream's list, and a wait made
//! on its earlier record keeps waiting for that one. Spares are destroyed at
//! the allocator's drop ([`Streams::destroy_events`]).
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
//! fails with [`capturing`]'s typed error. A free that records an event
//! asks first; placement asks about the streams whose pending frees lie
//! under the block it chose, and passes over a range a capturing stream
//! freed (`Core::under_capture`).
//!
//! A forgotten stream ([`Streams::forget`]: its owner destroys it) keeps its
//! index, as a tombstone whose work is all complete: its handle is never
//! passed to the driver again, and a later stream with the same handle is a
//! new stream.

use std::collections::VecDeque;
use std::sync::Arc;

use rustc_hash::FxHashMap as HashMap;

use quilt_vmm::{EventId, StreamId, Vmm, VmmError};

use super::config::EventTiming;

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

/// What an event recorded on demand is for (see [`Streams::know`] and
/// [`Streams::cover`]), and one recorded at a free ([`Streams::note_free`]),
/// as a failed record logs it.
const ON_DEMAND: &str = "recording an event on demand";
const AT_FREE: &str = "recording an event at a free";

/// Log an event call that failed (`what`: the call and its purpose). These
/// calls only spare waits and synchronisations, so their failure is logged,
/// not returned. Cold and out of line, so that the hot paths which make
/// these calls stay small.
#[cold]
#[inline(never)]
fn event_call_failed(what: &str, err: &VmmError) {
    tracing::warn!(error = %err, "{what} failed");
}

/// A spare event `e` whose record on stream `id` failed (`err`): logged
/// and destroyed (its id may not be live any more; at worst the destroy
/// fails too and is logged), and a new event recorded instead. Cold and
/// out of line, as [`event_call_failed`].
#[cold]
#[inline(never)]
fn record_instead_of_spare(
    vmm: &dyn Vmm,
    id: StreamId,
    e: EventId,
    err: &VmmError,
) -> Result<EventId, VmmError> {
    event_call_failed("recording a spare event again", err);
    if let Err(err) = vmm.event_destroy(e) {
        event_call_failed("destroying a spare event", &err);
    }
    vmm.event_record(id)
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

/// A free queries its stream only once this many of the stream's events
/// wait to be known complete: what a decision needs to know it learns
/// itself (placement, a wait, a reclaim, each querying first), so the
/// free's query only keeps the list short, and one query retires half of
/// it.
const POLL_AT_FREE: usize = 4;

/// Keep the completed event `e` for reuse (see the module documentation).
fn retire(spare: &mut Vec<EventId>, e: EventId) {
    spare.push(e);
}

/// An event recorded on a stream and not yet known complete.
#[derive(Debug)]
struct Marker {
    /// The tick it was recorded at: it covers the stream's work up to that
    /// operation.
    tick: u64,
    event: EventId,
    /// The stream's `waited` when it was recorded (`None`: it had waited for
    /// no stream then): a stream that waits on this event is ordered after
    /// that work too.
    waited: Option<Arc<Vec<u64>>>,
}

/// One stream's progress.
#[derive(Debug)]
struct StreamState {
    id: StreamId,
    /// Events recorded and not yet known complete, oldest first.
    events: VecDeque<Marker>,
    /// Work enqueued up to this tick is known complete.
    done: u64,
    /// The tick of the latest event recorded here or synchronisation of
    /// this stream: `done` and every `waited` of it only ever take such
    /// ticks (see [`Streams::last_mark`]).
    marked: u64,
    /// Tick of the latest free on this stream.
    last_free: u64,
    /// `(at, from)`: a query at tick `at` found this stream's event of tick
    /// `from` running, so every event from `from` on was running then.
    running: (u64, u64),
    /// The growth path's query waits for this tick: the queried event's
    /// age at its last query, which found it running, doubled.
    due_at: u64,
    /// A free queries the stream's list once it is this long (at least
    /// [`POLL_AT_FREE`]): twice what it kept after the last such query.
    poll_len: usize,
    /// `waited[s]`: this stream is ordered after stream `s`'s work up to
    /// this tick (by its own waits and the waits those waited-on events
    /// came after). Shared with the events recorded since it last changed.
    waited: Arc<Vec<u64>>,
    /// The tick at which [`Streams::capturing`] last asked the driver
    /// (`u64::MAX`: never), and its answer.
    capture_asked_at: u64,
    capturing: bool,
    /// Forgotten ([`Streams::forget`]): a tombstone whose work is all
    /// complete; its handle is never passed to the driver again.
    forgotten: bool,
}

impl StreamState {
    /// The part of this stream's work up to tick `k` that freed memory can
    /// depend on: up to its last free. Work enqueued on a stream after its
    /// last free cannot touch memory it freed (a range freed by several
    /// streams, or a page's hazard, carries the latest free of any of
    /// them, which may be later than this stream's).
    fn relevant(&self, k: u64) -> u64 {
        k.min(self.last_free)
    }

    /// True when that part ([`StreamState::relevant`]) is known complete.
    fn freed_done(&self, k: u64) -> bool {
        self.done >= self.relevant(k)
    }

    /// Whether the stream is capturing a CUDA graph now: asked of the
    /// driver at most once per operation `tick` (see [`Streams::capturing`]).
    fn capturing(&mut self, vmm: &dyn Vmm, tick: u64) -> bool {
        if self.forgotten {
            return false;
        }
        if self.capture_asked_at != tick {
            self.ask_capturing(vmm, tick);
        }
        self.capturing
    }

    /// Ask the driver whether the stream is capturing, at operation `tick`
    /// (out of line: at most once per stream per operation).
    #[inline(never)]
    fn ask_capturing(&mut self, vmm: &dyn Vmm, tick: u64) {
        self.capturing = match vmm.stream_is_capturing(self.id) {
            Ok(c) => c,
            Err(err) => {
                event_call_failed("asking whether a stream is capturing", &err);
                true
            }
        };
        self.capture_asked_at = tick;
    }

    /// The position in the list of the earliest event recorded at tick `k`
    /// or later (the list's length when none is).
    #[inline]
    fn covering(&self, k: u64) -> usize {
        let (older, newer) = self.events.as_slices();
        if older.last().is_some_and(|m| m.tick >= k) {
            older.partition_point(|m| m.tick < k)
        } else {
            older.len() + newer.partition_point(|m| m.tick < k)
        }
    }

    /// Query the event at `at` in the list, unless a query this operation
    /// `tick` found it or an earlier one running already. Found complete:
    /// it and every older event are retired to `spare` (events of a stream
    /// complete in order), and the stream's work is known complete up to
    /// its tick (returns true when that is further than known). Found
    /// running: every later event is known running this operation, and the
    /// growth path's query waits for twice its age. (Inlined: into
    /// [`Streams::know`], a decision's question, the rest rare.)
    #[inline(always)]
    fn query(&mut self, vmm: &dyn Vmm, at: usize, tick: u64, spare: &mut Vec<EventId>) -> bool {
        let Some(m) = self.events.get(at) else {
            return false;
        };
        let (asked_at, running_from) = self.running;
        if asked_at == tick && m.tick >= running_from {
            return false;
        }
        match vmm.event_query(m.event) {
            Ok(true) => {
                let done = m.tick;
                for _ in 0..=at {
                    if let Some(m) = self.events.pop_front() {
                        retire(spare, m.event);
                    }
                }
                self.due_at = 0;
                if done > self.done {
                    self.done = done;
                    return true;
                }
            }
            Ok(false) => {
                if asked_at != tick || m.tick < running_from {
                    self.running = (tick, m.tick);
                }
                // Running at age `tick - m.tick`: due again at twice that age.
                self.due_at = tick.saturating_add(tick - m.tick.min(tick)).max(tick + 1);
            }
            Err(err) => event_call_failed("querying an event", &err),
        }
        false
    }

    /// Record an event on the stream at `tick` where one may be: none on a
    /// forgotten or capturing stream, and a failed record is only logged
    /// (`why`: what the event was for, [`event_call_failed`]). Returns true
    /// when one was recorded. (Out of line: on demand, at a free or on the
    /// growth path, most operations record none.)
    #[inline(never)]
    fn record_unless_capturing(
        &mut self,
        vmm: &dyn Vmm,
        spare: &mut Vec<EventId>,
        tick: u64,
        why: &str,
    ) -> bool {
        if self.forgotten || self.capturing(vmm, tick) {
            return false;
        }
        match self.record(vmm, spare, tick) {
            Ok(_) => true,
            Err(err) => {
                event_call_failed(why, &err);
                false
            }
        }
    }

    /// Record an event on the stream at `tick` and add it to its list (see
    /// [`Streams::record`]): a spare from `spare` recorded again if there is
    /// one, else a new one.
    fn record(
        &mut self,
        vmm: &dyn Vmm,
        spare: &mut Vec<EventId>,
        tick: u64,
    ) -> Result<EventId, VmmError> {
        if self.forgotten || self.capturing(vmm, tick) {
            // Never reached for a forgotten stream (its work is all done),
            // and a record on a capturing stream would be a graph node.
            return Err(capturing(quilt_vmm::CallKind::EventRecord, self.id));
        }
        let e = match spare.pop() {
            Some(e) => match vmm.event_record_on(e, self.id) {
                Ok(()) => e,
                Err(err) => record_instead_of_spare(vmm, self.id, e, &err)?,
            },
            None => vmm.event_record(self.id)?,
        };
        let waited = (!self.waited.is_empty()).then(|| Arc::clone(&self.waited));
        self.events.push_back(Marker {
            tick,
            event: e,
            waited,
        });
        self.marked = tick;
        Ok(e)
    }
}

/// Every stream seen, by dense index. See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    index: HashMap<StreamId, u32>,
    states: Vec<StreamState>,
    /// Events recorded over the allocator's life (for tests and reports).
    pub(crate) recorded: u64,
    /// Completed events kept for reuse (see the module documentation).
    spare: Vec<EventId>,
    /// Cross-stream waits made.
    pub(crate) waits: u64,
    /// Stream synchronisations made.
    pub(crate) syncs: u64,
    /// Bumped whenever some stream's work becomes known complete further
    /// (its `done` grows): what is known complete is as it was while this
    /// is unchanged (a gap pruned of its completed hazards at this value
    /// needs no pruning again, see `Pruning`).
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
    #[inline]
    pub(crate) fn index(&mut self, id: StreamId) -> (u32, bool) {
        match self.recent {
            Some((r, i)) if r == id => (i, false),
            _ => self.look_up(id),
        }
    }

    /// [`Streams::index`] of a stream other than the one asked for last.
    /// (Out of line: most requests name the stream of the one before.)
    #[inline(never)]
    fn look_up(&mut self, id: StreamId) -> (u32, bool) {
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
            running: (u64::MAX, 0),
            due_at: 0,
            poll_len: POLL_AT_FREE,
            waited: Arc::new(Vec::new()),
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
        self.states
            .get_mut(i as usize)
            .is_some_and(|s| s.capturing(vmm, tick))
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
        for m in s.events.drain(..) {
            retire(&mut self.spare, m.event);
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

    /// The latest tick at which an event was recorded on a stream in `mask`
    /// or one of them was synchronised (0: never). What is known of a
    /// stream's progress (how far its work is known complete, how far
    /// another stream waited for it) only ever stops at such ticks, so two
    /// frees of the same streams both later than this are told apart by no
    /// decision, now or later: their hazards may be one (see
    /// `Tiling::vacate_leaving`).
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
        self.states.get(i as usize).is_none_or(|s| s.freed_done(k))
    }

    /// True when [`Streams::freed_done`] holds for every stream in `mask`:
    /// a hazard of theirs up to `k` constrains nothing.
    pub(crate) fn all_freed_done(&self, mask: u64, k: u64) -> bool {
        self.in_mask(mask).all(|s| self.freed_done(s, k))
    }

    /// True when stream `t` needs nothing of stream `s`'s work up to `k` (as
    /// far as freed memory can depend on it): `s` is `t`, or that work is
    /// known complete, or `t` is already ordered after it. Known without a
    /// call.
    pub(crate) fn orders_nothing(&self, t: u32, s: u32, k: u64) -> bool {
        s == t || self.relevant_unordered(t, s, k).is_none()
    }

    /// The part of stream `s`'s work up to `k` that freed memory can depend
    /// on ([`StreamState::relevant`]), when it is neither known complete
    /// nor waited for by stream `t`; `None` when `t` needs nothing of it,
    /// or `s` is unknown.
    #[inline]
    fn relevant_unordered(&self, t: u32, s: u32, k: u64) -> Option<u64> {
        let st = self.states.get(s as usize)?;
        let k = st.relevant(k);
        (st.done < k && self.waited(t, s) < k).then_some(k)
    }

    /// Whether stream `t` must wait for the work up to tick `k` of a stream
    /// in `mask` (a hazard's streams) other than itself: true at the first
    /// such stream, lowest index first, not known without a call to order
    /// nothing for `t` ([`Streams::orders_nothing`]) and, with `ask` (the
    /// device), found still running once learnt at operation `tick`
    /// ([`Streams::learn`]); without `ask`, nothing is asked and the first
    /// such stream counts. Bits of streams not seen yet name none.
    #[inline]
    pub(crate) fn must_wait_for(
        &mut self,
        t: u32,
        mask: u64,
        k: u64,
        (ask, tick): (Option<&dyn Vmm>, u64),
    ) -> bool {
        // Stream `t`'s own bit orders nothing (unless shared, past the 62nd).
        let own = if t < 63 { 1u64 << t } else { 0 };
        let mut low = mask & !own & !(1 << 63);
        while low != 0 {
            let s = low.trailing_zeros();
            low &= low - 1;
            if self.must_wait_on(t, s, k, (ask, tick)) {
                return true;
            }
        }
        mask & (1 << 63) != 0 && self.must_wait_for_shared(t, k, (ask, tick))
    }

    /// [`Streams::must_wait_for`] for the streams from the 63rd on, which
    /// share bit 63. (Out of line: only programs of over 63 streams.)
    #[inline(never)]
    fn must_wait_for_shared(&mut self, t: u32, k: u64, ask: (Option<&dyn Vmm>, u64)) -> bool {
        (63..self.states.len() as u32).any(|s| s != t && self.must_wait_on(t, s, k, ask))
    }

    /// [`Streams::must_wait_for`] for stream `s`, other than `t`.
    #[inline]
    fn must_wait_on(
        &mut self,
        t: u32,
        s: u32,
        k: u64,
        (ask, tick): (Option<&dyn Vmm>, u64),
    ) -> bool {
        let Some(k) = self.relevant_unordered(t, s, k) else {
            return false;
        };
        match ask {
            Some(vmm) => self.know(vmm, s, k, tick),
            None => true,
        }
    }

    /// Query stream `i`'s event at `at` in its list (see
    /// [`StreamState::query`]).
    fn query(&mut self, vmm: &dyn Vmm, i: u32, at: usize, tick: u64) {
        if let Some(s) = self.states.get_mut(i as usize) {
            if s.query(vmm, at, tick, &mut self.spare) {
                self.progress += 1;
            }
        }
    }

    /// The position in stream `i`'s list of its earliest event that covers
    /// its work up to tick `k` (recorded at `k` or later), if any.
    fn covering(&self, i: u32, k: u64) -> Option<usize> {
        let s = self.states.get(i as usize)?;
        let at = s.covering(k);
        (at < s.events.len()).then_some(at)
    }

    /// Learn whether stream `i`'s work up to tick `k` is complete, for a
    /// decision that depends on it: unless that is known (complete, or
    /// its covering event running this operation), query the earliest
    /// event that covers it, recorded now, on demand, if none does (see
    /// [`Streams::cover`] and [`StreamState::query`]). Returns true while
    /// that work is not known complete.
    #[inline(never)]
    fn know(&mut self, vmm: &dyn Vmm, i: u32, k: u64, tick: u64) -> bool {
        let Some(s) = self.states.get_mut(i as usize) else {
            return false;
        };
        if s.done >= k {
            return false;
        }
        let (asked_at, running_from) = s.running;
        if asked_at == tick && k > running_from {
            return true;
        }
        let at = s.covering(k);
        if at == s.events.len() {
            // None covers it: one recorded now goes at `at`.
            if !s.record_unless_capturing(vmm, &mut self.spare, tick, ON_DEMAND) {
                return true;
            }
            self.recorded += 1;
        }
        if s.query(vmm, at, tick, &mut self.spare) {
            self.progress += 1;
        }
        s.done < k
    }

    /// Learn whether the part of stream `i`'s work up to tick `k` that
    /// freed memory can depend on is complete, for a decision that depends
    /// on it (placement, a wait, a reclaim). A stream that has caught up
    /// then needs no wait.
    pub(crate) fn learn(&mut self, vmm: &dyn Vmm, i: u32, k: u64, tick: u64) {
        let Some(s) = self.states.get(i as usize) else {
            return;
        };
        // As far as freed memory can depend on it (see `relevant`).
        let k = k.min(s.last_free);
        if s.done < k {
            self.know(vmm, i, k, tick);
        }
    }

    /// Make sure an event of stream `i` covers its work up to tick `k`:
    /// when none does (a free on a capturing stream, or work not freed),
    /// one is recorded now, on demand (it covers all of the stream's work
    /// so far; on an idle stream it is complete at once). Nothing on a
    /// forgotten or capturing stream. A failed record is only logged: waits
    /// and synchronisations do without events.
    fn cover(&mut self, vmm: &dyn Vmm, i: u32, k: u64, tick: u64) {
        let Some(s) = self.states.get_mut(i as usize) else {
            return;
        };
        let covered = s.events.back().map_or(s.done, |m| m.tick);
        if covered < k && s.record_unless_capturing(vmm, &mut self.spare, tick, ON_DEMAND) {
            self.recorded += 1;
        }
    }

    /// Stream `i` freed a block at `tick`. With events at frees
    /// (`events`, [`EventTiming::AtFree`]) and several streams known, an
    /// event is recorded on the stream now, covering its work up to the
    /// free (none where its newest event is of this tick, its work is known
    /// complete up to here, or it is capturing; none while one stream is
    /// alone, so that a one-stream program pays no event). Once the
    /// stream's list is twice as long as the last such query left it (and
    /// at least [`POLL_AT_FREE`]), the event halfway down is queried: found
    /// complete, it retires half the list; so the list stays within twice
    /// the events the device has not reached, at one query per that many
    /// frees.
    pub(crate) fn note_free(&mut self, vmm: &dyn Vmm, i: u32, tick: u64, events: EventTiming) {
        let hazard = events.at_free() && self.states.len() > 1;
        let Some(s) = self.states.get_mut(i as usize) else {
            return;
        };
        s.last_free = tick;
        if hazard {
            let covered = s.events.back().map_or(s.done, |m| m.tick);
            if covered < tick && s.record_unless_capturing(vmm, &mut self.spare, tick, AT_FREE) {
                self.recorded += 1;
            }
        }
        if let Some(s) = self.states.get(i as usize) {
            if s.events.len() >= s.poll_len {
                self.poll_at_free(vmm, i, tick);
            }
        }
    }

    /// [`Streams::note_free`]'s query of stream `i`'s event halfway down
    /// its list, at operation `tick`, and the list length that makes the
    /// next free query. Out of line: once per that many frees.
    #[inline(never)]
    fn poll_at_free(&mut self, vmm: &dyn Vmm, i: u32, tick: u64) {
        let len = self.states.get(i as usize).map_or(0, |s| s.events.len());
        self.query(vmm, i, len / 2, tick);
        if let Some(s) = self.states.get_mut(i as usize) {
            s.poll_len = (2 * s.events.len()).max(POLL_AT_FREE);
        }
    }

    /// Record an event on stream `i` at `tick` and add it to the stream's
    /// list: a spare recorded again if there is one, else a new one. A spare
    /// whose record fails is logged and destroyed (its id may not be live
    /// any more; at worst the destroy fails too and is logged), and a new
    /// event is recorded instead.
    fn record(&mut self, vmm: &dyn Vmm, i: u32, tick: u64) -> Result<EventId, VmmError> {
        let Some(s) = self.states.get_mut(i as usize) else {
            return Err(capturing(
                quilt_vmm::CallKind::EventRecord,
                StreamId::default(),
            ));
        };
        let e = s.record(vmm, &mut self.spare, tick)?;
        self.recorded += 1;
        Ok(e)
    }

    /// On the growth path (a driver call follows anyway): learn the progress
    /// of up to `REFRESH_STREAMS` streams, round robin, first recording
    /// events where frees are uncovered, then querying each due stream's
    /// newest event (a device already past them says so at once).
    pub(crate) fn refresh(&mut self, vmm: &dyn Vmm, tick: u64) {
        let n = self.states.len();
        for _ in 0..n.min(REFRESH_STREAMS) {
            let i = (self.cursor % n) as u32;
            self.cursor = self.cursor.wrapping_add(1);
            let Some(s) = self.states.get(i as usize) else {
                continue;
            };
            let last_free = s.last_free;
            self.cover(vmm, i, last_free, tick);
            let Some(s) = self.states.get(i as usize) else {
                continue;
            };
            if tick >= s.due_at && !s.events.is_empty() {
                self.query(vmm, i, s.events.len() - 1, tick);
            }
        }
    }

    /// Order stream `t`'s later work after stream `s`'s work up to tick `k`:
    /// nothing when `s` is `t`, when that work is known complete (after a
    /// query), or when `t` is already ordered after it; else one
    /// `cuStreamWaitEvent` on the earliest event of `s` that covers every
    /// free `s` has made so far (one recorded now if none does). `t` is then
    /// ordered after `s`'s work up to that event, and after whatever `s` was
    /// ordered after when it was recorded (see the module documentation).
    /// Returns true when a wait was made.
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
        // Every free of `s` so far (`relevant` never goes past it).
        let k = self.states.get(s as usize).map_or(0, |st| st.last_free);
        if self.covering(s, k).is_none() {
            self.record(vmm, s, tick)?;
        }
        let Some(m) = self
            .covering(s, k)
            .and_then(|at| self.states.get(s as usize)?.events.get(at))
        else {
            return Ok(false);
        };
        let (et, e, inherited) = (m.tick, m.event, m.waited.clone());
        vmm.stream_wait_event(self.id(t), e)?;
        self.waits += 1;
        if let Some(ts) = self.states.get_mut(t as usize) {
            let waited = Arc::make_mut(&mut ts.waited);
            let len = inherited
                .as_ref()
                .map_or(0, |w| w.len())
                .max(s as usize + 1);
            if waited.len() < len {
                waited.resize(len, 0);
            }
            for (mine, &theirs) in waited
                .iter_mut()
                .zip(inherited.iter().flat_map(|w| w.iter()))
            {
                *mine = (*mine).max(theirs);
            }
            if let Some(w) = waited.get_mut(s as usize) {
                *w = (*w).max(et);
            }
        }
        Ok(true)
    }

    /// How far stream `t` is ordered after stream `s`.
    pub(crate) fn waited(&self, t: u32, s: u32) -> u64 {
        self.states
            .get(t as usize)
            .and_then(|st| st.waited.get(s as usize))
            .copied()
            .unwrap_or(0)
    }

    /// Make stream `i`'s work up to `k` complete: learn it (an event
    /// covering it queried), and synchronise the stream if it is still
    /// running. Returns true when it synchronised.
    pub(crate) fn complete(
        &mut self,
        vmm: &dyn Vmm,
        i: u32,
        k: u64,
        tick: u64,
    ) -> Result<bool, VmmError> {
        self.know(vmm, i, k, tick);
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
        for m in s.events.drain(..) {
            retire(&mut self.spare, m.event);
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
            for m in s.events.drain(..) {
                let _ = vmm.event_destroy(m.event);
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
    use quilt_vmm::sim::{SimConfig, SimVmm};
    use quilt_vmm::CallKind;

    /// A simulated device whose work completes `lag` operations after it
    /// was queued, and `n` streams registered (indices 0.., ids 100..).
    fn device(lag: u64, n: u64) -> (SimVmm, Streams) {
        let sim = SimVmm::new(SimConfig {
            gpu_lag_ops: lag,
            ..SimConfig::default()
        })
        .unwrap();
        let mut st = Streams::default();
        for id in 0..n {
            st.index(StreamId(100 + id));
        }
        (sim, st)
    }

    /// Stream `i` (registered by [`device`]) queues work and frees a block
    /// at `tick`, with events at frees.
    fn work_and_free(sim: &SimVmm, st: &mut Streams, i: u32, tick: u64) {
        sim.queue_work(StreamId(100 + u64::from(i)));
        st.note_free(sim, i, tick, EventTiming::AtFree);
    }

    #[test]
    fn a_frees_event_tells_its_work_complete_while_later_work_still_runs() {
        let (sim, mut st) = device(4, 2);
        let (a, b) = (0, 1);
        work_and_free(&sim, &mut st, a, 1);
        sim.advance(4); // the work before the first free completes
        work_and_free(&sim, &mut st, a, 2);
        assert_eq!(st.recorded, 2, "one event at each free");
        // b reuses what a freed first: no wait (its event is complete, the
        // stream's later work is not); what a freed second: one wait.
        assert!(!st.order_after(&sim, b, a, 1, 3).unwrap());
        assert!(st.freed_done(a, 1) && !st.freed_done(a, 2));
        assert!(st.order_after(&sim, b, a, 2, 3).unwrap());
        assert_eq!(st.waits, 1);
        assert_eq!(st.recorded, 2, "decisions recorded nothing");
        assert!(st.orders_nothing(b, a, 2));
    }

    #[test]
    fn one_query_retires_every_older_event_and_a_running_one_answers_for_later_ones() {
        let (sim, mut st) = device(4, 2);
        let a = 0;
        for tick in 1..=3 {
            work_and_free(&sim, &mut st, a, tick);
        }
        sim.advance(4);
        let queries = |sim: &SimVmm| sim.driver_stats().count(CallKind::EventQuery);
        st.learn(&sim, a, 3, 4);
        assert_eq!(queries(&sim), 1);
        assert!(st.freed_done(a, 3));
        assert_eq!(st.spare.len(), 3, "all three events retired, for reuse");
        // Two more frees reuse them; nothing completes; the earliest event
        // found running answers for the later one in the same operation.
        work_and_free(&sim, &mut st, a, 5);
        work_and_free(&sim, &mut st, a, 6);
        assert_eq!(st.spare.len(), 1);
        assert_eq!(sim.driver_stats().count(CallKind::EventRecord), 5);
        st.learn(&sim, a, 5, 7);
        st.learn(&sim, a, 6, 7);
        assert_eq!(queries(&sim), 2);
        assert!(!st.freed_done(a, 5));
    }

    #[test]
    fn a_free_without_hazard_or_on_a_capturing_stream_records_nothing() {
        let (sim, mut st) = device(4, 2);
        let a = 0;
        sim.queue_work(StreamId(100));
        st.note_free(&sim, a, 1, EventTiming::OnDemand);
        assert_eq!(st.recorded, 0);
        sim.begin_capture(StreamId(100)).unwrap();
        st.note_free(&sim, a, 2, EventTiming::AtFree);
        assert_eq!(st.recorded, 0);
        sim.end_capture(StreamId(100)).unwrap();
        assert_eq!(sim.capture_violations(), 0);
        // A decision after the capture records the event it needs then.
        st.learn(&sim, a, 2, 3);
        assert_eq!(st.recorded, 1);
    }

    #[test]
    fn a_wait_orders_after_what_the_waited_on_stream_was_ordered_after_at_the_record() {
        // Nothing completes: only waits order anything.
        let (sim, mut st) = device(1 << 20, 3);
        let (a, b, c) = (0, 1, 2);
        let (sa, sc) = (StreamId(100), StreamId(102));
        work_and_free(&sim, &mut st, c, 1);
        let c1 = sim.stream_position(sc) - 1; // c's work before its event
        assert!(st.order_after(&sim, b, c, 1, 2).unwrap());
        work_and_free(&sim, &mut st, b, 3); // b's event comes after its wait
        work_and_free(&sim, &mut st, c, 4);
        let c4 = sim.stream_position(sc) - 1;
        assert!(st.order_after(&sim, b, c, 4, 5).unwrap()); // after b's event
        assert!(st.order_after(&sim, a, b, 3, 6).unwrap());
        assert_eq!(st.waits, 3);
        // a is ordered after c's first free through b, not after its second.
        assert!(st.orders_nothing(a, c, 1) && sim.ordered_after(sa, sc, c1));
        assert!(!st.orders_nothing(a, c, 4) && !sim.ordered_after(sa, sc, c4));
        assert!(st.order_after(&sim, a, c, 4, 7).unwrap());
    }

    #[test]
    fn a_hazard_waits_for_no_stream_of_its_own_bit_and_for_any_other_sharing_bit_63() {
        // Nothing completes; 66 streams, so 63, 64 and 65 share bit 63.
        let (sim, mut st) = device(1 << 20, 66);
        let no_ask = (None, 7);
        for i in [0, 63] {
            sim.queue_work(StreamId(100 + u64::from(i)));
            st.note_free(&sim, i, 5, EventTiming::OnDemand);
        }
        // Stream 0's own hazard orders nothing for it; stream 1 must wait.
        assert!(!st.must_wait_for(0, 1, 5, no_ask));
        assert!(st.must_wait_for(1, 1, 5, no_ask));
        // Bit 63: stream 63's frees, for 64 and 65; 63's own, for nothing
        // (64 and 65 freed nothing), and bit 63 is not its own bit alone.
        assert!(st.must_wait_for(64, 1 << 63, 5, no_ask));
        assert!(st.must_wait_for(1, 1 << 63, 5, no_ask));
        assert!(!st.must_wait_for(63, 1 << 63, 5, no_ask));
        // Asking the device: stream 63's work is still running.
        assert!(st.must_wait_for(65, 1 << 63, 5, (Some(&sim), 7)));
        assert_eq!(st.recorded, 1, "an event recorded on demand to ask");
        assert!(!st.freed_done(63, 5));
    }

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
