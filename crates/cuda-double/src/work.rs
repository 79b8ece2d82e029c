//! Streams, events, queued work and stream capture.
//!
//! Work queued on a stream never runs inside the call that queued it. It
//! runs, in stream order, when something waits for it (a stream, event or
//! context synchronisation, a synchronous copy to host memory, another
//! stream's queued wait as that runs) or by itself once `rules.lag` later
//! driver calls have been made. A query (`cuEventQuery`, `cuStreamQuery`)
//! does not make work run: it reports what has run. Work that touches
//! device memory not mapped with the access it needs when it runs is a
//! fault: the context is poisoned with `CUDA_ERROR_ILLEGAL_ADDRESS`, which
//! every later call that needs the context returns, and its queued work is
//! dropped.
//!
//! The legacy default stream (`NULL`, `CU_STREAM_LEGACY`) waits for the work
//! of every blocking stream of its context queued before, and every blocking
//! stream waits for the legacy stream's; `CU_STREAM_PER_THREAD` is a
//! blocking stream of the calling thread's own.
//!
//! Capture (`cuStreamBeginCapture`): work queued on a capturing stream is
//! recorded into the graph, never run; an event recorded there is a captured
//! event, which `cuEventQuery` and `cuEventSynchronize` refuse
//! (`CUDA_ERROR_CAPTURED_EVENT`); synchronising a capturing stream or its
//! context fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates
//! the capture; queuing on the legacy stream while a blocking stream of its
//! context captures fails (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`) and
//! invalidates it, as does synchronising or querying the legacy stream then
//! (it would synchronise or query the capture), in any capture mode.
//! "Potentially unsafe" calls (memory allocation and mapping,
//! synchronisations, queries) are refused and invalidate the
//! capture where the calling thread's mode prohibits them (CUDA's rule: in
//! global mode, while any thread captures in global mode or this thread
//! captures in a mode other than relaxed; in thread-local mode, while this
//! thread captures in a mode other than relaxed; never in relaxed mode).

use std::collections::VecDeque;
use std::ffi::c_int;
use std::thread::{self, ThreadId};

use crate::abi::*;
use crate::os;
use crate::state::{self, Call, Driver};

/// What a stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// The context's legacy default stream.
    Legacy,
    /// A thread's per-thread default stream.
    PerThread(ThreadId),
    /// Made by `cuStreamCreate` with these flags.
    Created(u32),
}

/// One piece of queued work.
#[derive(Debug, Clone)]
pub enum Op {
    /// Nothing (an event's record point, or implicit waits only).
    Marker,
    /// A kernel launched through the runtime face: work whose memory
    /// footprint the double cannot know. It computes nothing and touches
    /// nothing when it runs, but it keeps its stream busy until it runs
    /// (queries answer `CUDA_ERROR_NOT_READY`), as any queued work does.
    Kernel,
    /// Writes bytes staged from pageable host memory when queued.
    Write {
        /// Device address.
        dst: u64,
        /// The device whose access to `dst` the write uses (`peer.rs`).
        device: CuDevice,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// Copies between device memory or from/to pinned host memory.
    Copy {
        /// Destination.
        dst: u64,
        /// Where `dst` is device memory, the device whose access to it the
        /// copy uses (`peer.rs`); `None` for pinned host memory.
        dst_device: Option<CuDevice>,
        /// Source.
        src: u64,
        /// Where `src` is device memory, the device whose access to it the
        /// copy uses; `None` for pinned host memory.
        src_device: Option<CuDevice>,
        /// Bytes.
        len: u64,
    },
    /// Fills device memory with a 1- or 4-byte pattern.
    Fill {
        /// Device address.
        dst: u64,
        /// The pattern.
        pattern: Vec<u8>,
        /// Bytes.
        len: u64,
    },
    /// Waits for another stream's work up to a position.
    Wait {
        /// The stream.
        stream: u64,
        /// Its position.
        seq: u64,
    },
}

/// Queued work with its position and the call count at which it is due.
#[derive(Debug)]
pub struct Work {
    seq: u64,
    due: u64,
    op: Op,
}

/// A stream.
#[derive(Debug)]
pub struct Stream {
    /// Its context.
    pub context: u64,
    /// What it is.
    pub kind: StreamKind,
    queue: VecDeque<Work>,
    /// Work ever queued (the position of the last).
    pub submitted: u64,
    /// Position of the last work that ran.
    pub completed: u64,
    /// Destroyed by its user: its handle is invalid, its work still runs.
    pub destroyed: bool,
    /// The capture sequence it takes part in.
    pub capture: Option<u64>,
}

impl Stream {
    fn new(context: u64, kind: StreamKind) -> Stream {
        Stream {
            context,
            kind,
            queue: VecDeque::new(),
            submitted: 0,
            completed: 0,
            destroyed: false,
            capture: None,
        }
    }

    /// Whether it synchronises with the legacy stream.
    fn blocking(&self) -> bool {
        match self.kind {
            StreamKind::Legacy | StreamKind::PerThread(_) => true,
            StreamKind::Created(flags) => flags & STREAM_NON_BLOCKING == 0,
        }
    }
}

/// An event.
#[derive(Debug)]
pub struct Event {
    /// Its context.
    pub context: u64,
    /// `cuEventCreate` flags.
    pub flags: u32,
    /// Its last record outside capture: the stream and position.
    pub record: Option<(u64, u64)>,
    /// Last recorded inside this capture sequence.
    pub captured: Option<u64>,
}

/// A capture sequence.
#[derive(Debug)]
pub struct Capture {
    /// `CUstreamCaptureMode`.
    pub mode: c_int,
    /// The thread that began it.
    pub thread: ThreadId,
    /// The stream it began on.
    pub origin: u64,
    /// Invalidated by a forbidden call.
    pub invalidated: bool,
    /// The work queued on its streams so far, in the order it was queued
    /// (an order that respects every dependency the capture recorded, since
    /// a dependency is made by a call before the work that depends on it):
    /// the graph `cuStreamEndCapture` makes.
    pub ops: Vec<Op>,
}

/// The device address ranges a queued op touches: start, length, write,
/// and the device whose access it uses (`None`: the stream's).
fn device_ranges(op: &Op) -> Vec<(u64, u64, bool, Option<CuDevice>)> {
    match op {
        Op::Marker | Op::Kernel | Op::Wait { .. } => vec![],
        Op::Write { dst, device, bytes } => vec![(*dst, bytes.len() as u64, true, Some(*device))],
        Op::Fill { dst, len, .. } => vec![(*dst, *len, true, None)],
        Op::Copy {
            dst,
            dst_device,
            src,
            src_device,
            len,
        } => {
            let mut v = Vec::new();
            if let Some(d) = dst_device {
                v.push((*dst, *len, true, Some(*d)));
            }
            if let Some(d) = src_device {
                v.push((*src, *len, false, Some(*d)));
            }
            v
        }
    }
}

impl Driver {
    /// The internal stream a client's `CUstream` names: the current
    /// context's legacy stream for `NULL` and `CU_STREAM_LEGACY`, the calling
    /// thread's own for `CU_STREAM_PER_THREAD`, else a live stream
    /// (`CUDA_ERROR_INVALID_HANDLE` for any other value, destroyed ones
    /// included).
    pub fn stream(&mut self, handle: u64) -> Call<u64> {
        match handle {
            0 | STREAM_LEGACY => {
                let ctx = self.context()?;
                if let Some(s) = self.legacy.get(&ctx) {
                    return Ok(*s);
                }
                let s = self.new_handle();
                self.streams.insert(s, Stream::new(ctx, StreamKind::Legacy));
                self.legacy.insert(ctx, s);
                Ok(s)
            }
            STREAM_PER_THREAD => {
                let ctx = self.context()?;
                let me = thread::current().id();
                if let Some(s) = self.per_thread.get(&(me, ctx)) {
                    return Ok(*s);
                }
                let s = self.new_handle();
                self.streams
                    .insert(s, Stream::new(ctx, StreamKind::PerThread(me)));
                self.per_thread.insert((me, ctx), s);
                Ok(s)
            }
            h => match self.streams.get(&h) {
                Some(s) if !s.destroyed && matches!(s.kind, StreamKind::Created(_)) => {
                    self.live_context(s.context)?;
                    Ok(h)
                }
                _ => Err(CUDA_ERROR_INVALID_HANDLE),
            },
        }
    }

    /// `cuStreamCreate` in the current context.
    pub fn create_stream(&mut self, flags: u32) -> Call<u64> {
        if flags & !STREAM_NON_BLOCKING != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = self.context()?;
        let s = self.new_handle();
        self.streams
            .insert(s, Stream::new(ctx, StreamKind::Created(flags)));
        Ok(s)
    }

    /// `cuStreamDestroy`: the handle dies now, queued work still runs.
    pub fn destroy_stream(&mut self, handle: u64) -> Call<()> {
        if matches!(handle, 0 | STREAM_LEGACY | STREAM_PER_THREAD) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let s = self.stream(handle)?;
        if let Some(st) = self.streams.get_mut(&s) {
            if st.capture.is_some() {
                return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            st.destroyed = true;
        }
        Ok(())
    }

    /// The stream's flags (`cuStreamGetFlags`) and context.
    pub fn stream_info(&mut self, handle: u64) -> Call<(u32, u64)> {
        let s = self.stream(handle)?;
        let st = &self.streams[&s];
        let flags = match st.kind {
            StreamKind::Created(f) => f,
            _ => 0,
        };
        Ok((flags, st.context))
    }

    /// Queues `op` on stream `s` (after the implicit waits of the legacy
    /// stream), or records it into the graph where `s` captures. Returns the
    /// op's position.
    pub fn enqueue(&mut self, s: u64, op: Op) -> Call<u64> {
        let (ctx, kind, capture) = {
            let st = &self.streams[&s];
            (st.context, st.kind, st.capture)
        };
        if let Some(id) = capture {
            let c = self
                .captures
                .get_mut(&id)
                .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
            if c.invalidated {
                return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            // Ordering between the capture's streams is kept by the order of
            // the recorded work itself (see `Capture::ops`).
            if !matches!(op, Op::Marker | Op::Wait { .. }) {
                c.ops.push(op);
            }
            return Ok(self.streams[&s].submitted);
        }
        let mut waits = Vec::new();
        if kind == StreamKind::Legacy {
            self.legacy_free_of_capture(s)?;
            for (&t, st) in &self.streams {
                if t != s && st.context == ctx && st.blocking() && st.submitted > st.completed {
                    waits.push((t, st.submitted));
                }
            }
        } else if self.streams[&s].blocking() {
            if let Some(&l) = self.legacy.get(&ctx) {
                let st = &self.streams[&l];
                if st.submitted > st.completed {
                    waits.push((l, st.submitted));
                }
            }
        }
        let due = self.calls + self.rules.lag;
        let st = self.streams.get_mut(&s).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for (stream, seq) in waits {
            st.submitted += 1;
            let seq_here = st.submitted;
            st.queue.push_back(Work {
                seq: seq_here,
                due,
                op: Op::Wait { stream, seq },
            });
        }
        st.submitted += 1;
        let seq = st.submitted;
        st.queue.push_back(Work { seq, due, op });
        Ok(seq)
    }

    /// Refuses a use of stream `s` where it is the legacy stream and a
    /// blocking stream of its context captures (queuing on it would make
    /// the legacy stream depend on the capture; synchronising or querying it
    /// would synchronise or query the capture), invalidating those captures:
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, whatever the capture mode.
    fn legacy_free_of_capture(&mut self, s: u64) -> Call<()> {
        let capturing = self.captures_behind_legacy(s);
        if capturing.is_empty() {
            return Ok(());
        }
        for id in capturing {
            self.invalidate(id);
        }
        Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    }

    /// Where `s` is the legacy stream, the captures of the blocking streams
    /// of its context (which any use of it would depend on); else none.
    fn captures_behind_legacy(&self, s: u64) -> Vec<u64> {
        let st = &self.streams[&s];
        if st.kind != StreamKind::Legacy {
            return Vec::new();
        }
        let ctx = st.context;
        self.streams
            .values()
            .filter(|t| t.context == ctx && t.blocking() && !t.destroyed)
            .filter_map(|t| t.capture)
            .collect()
    }

    /// Runs stream `s`'s work up to position `seq` (and what it waits for).
    pub fn run_until(&mut self, s: u64, seq: u64) {
        loop {
            let Some(st) = self.streams.get_mut(&s) else {
                return;
            };
            if st.completed >= seq {
                return;
            }
            let Some(work) = st.queue.pop_front() else {
                st.completed = st.submitted;
                return;
            };
            let ctx = st.context;
            if let Op::Wait { stream, seq } = work.op {
                self.run_until(stream, seq);
            } else {
                self.execute(ctx, &work.op);
            }
            if let Some(st) = self.streams.get_mut(&s) {
                st.completed = st.completed.max(work.seq);
            }
        }
    }

    /// Runs one op of context `ctx`: a fault where a device range is not
    /// mapped with the access it needs now (for the device the op reaches
    /// it through, `peer.rs`; else the context's).
    fn execute(&mut self, ctx: u64, op: &Op) {
        if self.contexts.get(&ctx).is_none_or(|c| c.poisoned.is_some()) {
            return;
        }
        let own = self.contexts[&ctx].device;
        for (ptr, len, write, through) in device_ranges(op) {
            let need = if write { ACCESS_READWRITE } else { ACCESS_READ };
            if !self
                .memory
                .accessible(ptr, len, through.unwrap_or(own), need)
            {
                eprintln!(
                    "quilt-cuda-double: illegal address: queued work {} {len} bytes at {ptr:#x}, not mapped with {} access when it ran; context poisoned",
                    if write { "writes" } else { "reads" },
                    if write { "read-write" } else { "read" },
                );
                self.poison(ctx);
                return;
            }
        }
        // SAFETY (for each arm): every device range was just checked mapped
        // with the access it needs; host ranges are pinned buffers the client
        // gave for `len` bytes (the API's contract).
        match op {
            Op::Marker | Op::Kernel | Op::Wait { .. } => {}
            Op::Write { dst, bytes, .. } => unsafe { os::write(*dst, bytes) },
            Op::Copy { dst, src, len, .. } => unsafe { os::copy(*dst, *src, *len) },
            Op::Fill { dst, pattern, len } => {
                let bytes: Vec<u8> = pattern
                    .iter()
                    .copied()
                    .cycle()
                    .take(*len as usize)
                    .collect();
                unsafe { os::write(*dst, &bytes) }
            }
        }
    }

    /// Poisons `ctx` and drops its queued work (a dead context runs nothing).
    fn poison(&mut self, ctx: u64) {
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.poisoned = Some(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        for st in self.streams.values_mut().filter(|s| s.context == ctx) {
            st.queue.clear();
            st.completed = st.submitted;
        }
    }

    /// Runs every piece of work that is due.
    pub fn run_due(&mut self) {
        let now = self.calls;
        let due: Vec<(u64, u64)> = self
            .streams
            .iter()
            .filter_map(|(&s, st)| {
                let last = st.queue.iter().take_while(|w| w.due <= now).last()?;
                Some((s, last.seq))
            })
            .collect();
        for (s, seq) in due {
            self.run_until(s, seq);
        }
        self.streams
            .retain(|_, st| !(st.destroyed && st.completed >= st.submitted));
    }

    /// Runs all queued work of every stream.
    pub fn run_all(&mut self) {
        let all: Vec<(u64, u64)> = self
            .streams
            .iter()
            .map(|(&s, st)| (s, st.submitted))
            .collect();
        for (s, seq) in all {
            self.run_until(s, seq);
        }
    }

    /// A host wait for stream `s` while it captures is refused and
    /// invalidates its capture (what CUDA does to a sync or query of a
    /// capturing stream).
    fn refuse_waiting_on_capture(&mut self, s: u64) -> Call<()> {
        if let Some(id) = self.streams[&s].capture {
            self.invalidate(id);
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// The sticky error of `ctx`, if any.
    fn sticky(&self, ctx: u64) -> Call<()> {
        self.live_context(ctx).map(|_| ())
    }

    /// `cuStreamSynchronize`.
    pub fn synchronize_stream(&mut self, handle: u64) -> Call<()> {
        let s = self.stream(handle)?;
        self.refuse_waiting_on_capture(s)?;
        self.legacy_free_of_capture(s)?;
        self.forbidden_under_capture()?;
        let (ctx, seq) = (self.streams[&s].context, self.streams[&s].submitted);
        self.run_until(s, seq);
        self.sticky(ctx)
    }

    /// Runs stream `s` up to position `seq` for a caller that waits for it
    /// (a copy into pageable host memory): refused on a capturing stream.
    pub fn synchronize_up_to(&mut self, s: u64, seq: u64) -> Call<()> {
        self.refuse_waiting_on_capture(s)?;
        self.forbidden_under_capture()?;
        self.run_until(s, seq);
        let ctx = self.streams.get(&s).map(|st| st.context).unwrap_or(0);
        self.sticky(ctx)
    }

    /// `cuStreamQuery`.
    pub fn query_stream(&mut self, handle: u64) -> Call<()> {
        let s = self.stream(handle)?;
        self.refuse_waiting_on_capture(s)?;
        self.legacy_free_of_capture(s)?;
        self.forbidden_under_capture()?;
        let st = &self.streams[&s];
        self.sticky(st.context)?;
        if st.completed >= st.submitted {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }

    /// `cuCtxSynchronize`.
    pub fn synchronize_context(&mut self) -> Call<()> {
        let ctx = self.context()?;
        self.synchronize_contexts(&[ctx])
    }

    /// Runs all work queued in the contexts `ctxs`; refused, invalidating
    /// the captures, where a stream of one of them captures.
    pub fn synchronize_contexts(&mut self, ctxs: &[u64]) -> Call<()> {
        let capturing: Vec<u64> = self
            .streams
            .values()
            .filter(|s| ctxs.contains(&s.context))
            .filter_map(|s| s.capture)
            .collect();
        if !capturing.is_empty() {
            for id in capturing {
                self.invalidate(id);
            }
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.forbidden_under_capture()?;
        let all: Vec<(u64, u64)> = self
            .streams
            .iter()
            .filter(|(_, st)| ctxs.contains(&st.context))
            .map(|(&s, st)| (s, st.submitted))
            .collect();
        for (s, seq) in all {
            self.run_until(s, seq);
        }
        ctxs.iter().try_for_each(|&ctx| self.sticky(ctx))
    }

    /// `cuEventCreate`.
    pub fn create_event(&mut self, flags: u32) -> Call<u64> {
        if flags & !EVENT_FLAGS_ALL != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = self.context()?;
        let e = self.new_handle();
        self.events.insert(
            e,
            Event {
                context: ctx,
                flags,
                record: None,
                captured: None,
            },
        );
        Ok(e)
    }

    fn event(&self, e: u64) -> Call<&Event> {
        self.events.get(&e).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// `cuEventDestroy`.
    pub fn destroy_event(&mut self, e: u64) -> Call<()> {
        self.events
            .remove(&e)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// `cuEventRecord`: captures the stream's work queued so far (inside a
    /// capture: a node of the graph, and the event is a captured event).
    pub fn record_event(&mut self, e: u64, stream: u64) -> Call<()> {
        self.event(e)?;
        let s = self.stream(stream)?;
        if let Some(id) = self.streams[&s].capture {
            if self.captures.get(&id).is_some_and(|c| c.invalidated) {
                return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            if let Some(ev) = self.events.get_mut(&e) {
                ev.captured = Some(id);
            }
            return Ok(());
        }
        let seq = self.enqueue(s, Op::Marker)?;
        if let Some(ev) = self.events.get_mut(&e) {
            ev.record = Some((s, seq));
            ev.captured = None;
        }
        Ok(())
    }

    /// Whether event `e`'s last record has run; `CUDA_ERROR_CAPTURED_EVENT`
    /// for an event last recorded in a capture.
    fn event_done(&self, e: u64) -> Call<bool> {
        let ev = self.event(e)?;
        if ev.captured.is_some() {
            return Err(CUDA_ERROR_CAPTURED_EVENT);
        }
        self.sticky(ev.context)?;
        Ok(match ev.record {
            None => true,
            Some((s, seq)) => self.streams.get(&s).is_none_or(|st| st.completed >= seq),
        })
    }

    /// `cuEventQuery`.
    pub fn query_event(&mut self, e: u64) -> Call<()> {
        self.event_done(e)?;
        self.forbidden_under_capture()?;
        if self.event_done(e)? {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }

    /// `cuEventSynchronize`.
    pub fn synchronize_event(&mut self, e: u64) -> Call<()> {
        self.event_done(e)?;
        self.forbidden_under_capture()?;
        if let Some((s, seq)) = self.events[&e].record {
            self.run_until(s, seq);
        }
        self.event_done(e).map(|_| ())
    }

    /// `cuEventElapsedTime`: both events done and timed.
    pub fn elapsed(&mut self, start: u64, end: u64) -> Call<f32> {
        for e in [start, end] {
            if self.event(e)?.flags & 0x2 != 0 || self.event(e)?.record.is_none() {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            if !self.event_done(e)? {
                return Err(CUDA_ERROR_NOT_READY);
            }
        }
        Ok(0.001)
    }

    /// `cuStreamWaitEvent`: the stream's later work waits for the event's
    /// last record. A stream waiting for a captured event joins its capture.
    pub fn wait_event(&mut self, stream: u64, e: u64, flags: u32) -> Call<()> {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (record, captured) = {
            let ev = self.event(e)?;
            (ev.record, ev.captured)
        };
        let s = self.stream(stream)?;
        if let Some(id) = captured {
            if self.streams[&s].capture.is_none() {
                if self.streams[&s].kind == StreamKind::Legacy {
                    self.invalidate(id);
                    return Err(CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
                }
                if let Some(st) = self.streams.get_mut(&s) {
                    st.capture = Some(id);
                }
            }
            return Ok(());
        }
        if let Some((rs, seq)) = record {
            self.enqueue(s, Op::Wait { stream: rs, seq })?;
        }
        Ok(())
    }

    /// Whether the calling thread may make a potentially unsafe call now;
    /// where not, the captures that forbid it are invalidated and the call
    /// fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
    pub fn forbidden_under_capture(&mut self) -> Call<()> {
        let mode = state::capture_mode();
        if mode == CAPTURE_MODE_RELAXED || self.captures.is_empty() {
            return Ok(());
        }
        let me = thread::current().id();
        let forbidding: Vec<u64> = self
            .captures
            .iter()
            .filter(|(_, c)| !c.invalidated)
            .filter(|(_, c)| {
                let own = c.thread == me && c.mode != CAPTURE_MODE_RELAXED;
                let global = c.thread != me && c.mode == CAPTURE_MODE_GLOBAL;
                own || (mode == CAPTURE_MODE_GLOBAL && global)
            })
            .map(|(id, _)| *id)
            .collect();
        if forbidding.is_empty() {
            return Ok(());
        }
        for id in forbidding {
            self.invalidate(id);
        }
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    }

    fn invalidate(&mut self, id: u64) {
        if let Some(c) = self.captures.get_mut(&id) {
            c.invalidated = true;
        }
    }

    /// `cuStreamBeginCapture`.
    pub fn begin_capture(&mut self, stream: u64, mode: c_int) -> Call<()> {
        if !matches!(
            mode,
            CAPTURE_MODE_GLOBAL | CAPTURE_MODE_THREAD_LOCAL | CAPTURE_MODE_RELAXED
        ) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = self.stream(stream)?;
        if self.streams[&s].kind == StreamKind::Legacy {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if self.streams[&s].capture.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let id = self.new_handle();
        self.captures.insert(
            id,
            Capture {
                mode,
                thread: thread::current().id(),
                origin: s,
                invalidated: false,
                ops: Vec::new(),
            },
        );
        if let Some(st) = self.streams.get_mut(&s) {
            st.capture = Some(id);
        }
        Ok(())
    }

    /// `cuStreamEndCapture`: the graph, or the error that invalidated it.
    pub fn end_capture(&mut self, stream: u64) -> Call<u64> {
        let s = self.stream(stream)?;
        let id = self.streams[&s].capture.ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        let c = &self.captures[&id];
        if c.origin != s {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
        }
        if c.mode != CAPTURE_MODE_RELAXED && c.thread != thread::current().id() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
        }
        let invalidated = c.invalidated;
        let ops = self.captures.remove(&id).map(|c| c.ops).unwrap_or_default();
        for st in self.streams.values_mut() {
            if st.capture == Some(id) {
                st.capture = None;
            }
        }
        if invalidated {
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let g = self.new_handle();
        self.graphs.insert(g, ops);
        Ok(g)
    }

    /// `cuGraphInstantiate`: an executable copy of graph `g`'s work.
    pub fn instantiate(&mut self, g: u64) -> Call<u64> {
        let ops = self.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)?.clone();
        let e = self.new_handle();
        self.execs.insert(e, ops);
        Ok(e)
    }

    /// `cuGraphLaunch`: queues the executable graph's work on `stream`, in
    /// its recorded order (recorded again where `stream` captures). Its
    /// copies and fills compute on the memory their addresses name when
    /// they run: a fault where it is not mapped then.
    pub fn launch_graph(&mut self, exec: u64, stream: u64) -> Call<()> {
        let ops = self
            .execs
            .get(&exec)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .clone();
        let s = self.stream(stream)?;
        for op in ops {
            self.enqueue(s, op)?;
        }
        Ok(())
    }

    /// `cuGraphGetNodes`' count: the graph's recorded work.
    pub fn graph_nodes(&self, g: u64) -> Call<usize> {
        self.graphs
            .get(&g)
            .map(Vec::len)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `cuStreamIsCapturing` / `cuStreamGetCaptureInfo`: status and id. For
    /// the legacy stream while a blocking stream of its context captures,
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, the capture left valid (as the
    /// reference states).
    pub fn capture_status(&mut self, stream: u64) -> Call<(c_int, u64)> {
        let s = self.stream(stream)?;
        if !self.captures_behind_legacy(s).is_empty() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
        }
        Ok(match self.streams[&s].capture {
            None => (CAPTURE_STATUS_NONE, 0),
            Some(id) if self.captures.get(&id).is_some_and(|c| c.invalidated) => {
                (CAPTURE_STATUS_INVALIDATED, id)
            }
            Some(id) => (CAPTURE_STATUS_ACTIVE, id),
        })
    }

    /// Checks that `[ptr, ptr + len)` is device memory mapped with `need`
    /// access for `device` now (a fill's or a copy's argument).
    pub fn check_device_range(
        &self,
        ptr: u64,
        len: u64,
        device: CuDevice,
        need: c_int,
    ) -> Call<()> {
        if len == 0 || self.memory.accessible(ptr, len, device, need) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }

    /// Whether `ptr` is device memory (lies in a mapping).
    pub fn is_device(&self, ptr: u64) -> bool {
        self.address_range(ptr).is_ok()
    }

    /// Whether `[ptr, ptr + len)` is a pinned host buffer of `cuMemHostAlloc`.
    pub fn is_pinned(&self, ptr: u64, len: u64) -> bool {
        self.host
            .range(..=ptr)
            .next_back()
            .is_some_and(|(s, b)| ptr + len <= s + b.len() as u64)
    }
}
