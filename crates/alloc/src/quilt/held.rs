//! Frees held for the streams a block was recorded on (`record_stream`), as
//! PyTorch's caching allocator holds them.
//!
//! A block allocated on stream `s` and recorded on other streams is used by
//! their work too. Freed while that work may still run, its range would go
//! to the next block placed over it behind a wait for those streams: safe,
//! but it chains `s` (or whichever stream reuses it) to them where PyTorch
//! gives fresh memory and lets the streams overlap. So such a free records
//! an event on each of the block's streams (covering its work up to the
//! free; its own stream's tells a later reuse by another stream how far to
//! wait) and is *held*: the block stays occupied (no longer allocated, still active,
//! a snapshot shows it pending free) and the next block gets other memory.
//! Each allocation while frees are held first learns whether those events
//! completed (one query per stream at most, as placement learns them) and
//! frees for good the blocks whose recorded work is done: their ranges then
//! carry only their own stream's work, so their own stream reuses them
//! without a wait. While a stream captures a CUDA graph the allocation it
//! makes asks nothing (no event query during a capture, as PyTorch skips
//! its `process_events`).
//!
//! Only under pressure does a held block's memory go behind a wait: an
//! allocation that runs out of memory while frees are held releases them
//! all with their recorded streams' hazards (counted in
//! `num_recorded_frees_forced`, and as an allocation retry) and tries once
//! more, placement then ordering the reuse after that work as for any other
//! stream's freed memory. `empty_cache` completes the recorded work first
//! (a synchronisation of the streams still running it, as PyTorch's
//! `synchronize_and_free_events`) and frees the held blocks.
//!
//! Not held: a block whose recorded streams' work is known complete, a
//! block freed while one of its streams captures (its hazard already keeps
//! other streams off it until the capture ends), and blocks of isolation
//! groups (tags, which sleep and wake whole arenas).

use quilt_vmm::{DevicePtr, StreamId};

use super::config::EventTiming;
use super::stitch::{BlockRec, Core, Ctx, HeldFree, Kind};
use super::streams::Streams;
use crate::api::Allocation;
use crate::error::AllocError;

/// The streams other than its own that `b` was recorded on (bits).
fn recorded(b: &BlockRec) -> u64 {
    b.streams & !Streams::bit(b.stream)
}

impl Core {
    /// Hold the free of block `b` at `ptr` (at this tick) when it was
    /// recorded on other streams whose work is not known complete: an
    /// event recorded on each of its streams, the allocated statistics lowered, the block
    /// kept occupied. Gives the block back when it is not held.
    pub(super) fn hold_free(
        &mut self,
        ctx: &Ctx<'_>,
        ptr: DevicePtr,
        b: BlockRec,
    ) -> Result<(), BlockRec> {
        let others = recorded(&b);
        if others == 0 || self.streams.len() < 2 {
            return Err(b);
        }
        if !matches!(
            self.arena_meta.get(b.arena),
            Some((_, Kind::Small | Kind::Large | Kind::Apart))
        ) {
            return Err(b);
        }
        let tick = self.tick;
        if self
            .streams
            .in_mask(others)
            .all(|s| self.streams.is_done(s, tick))
        {
            return Err(b);
        }
        let mut any_capturing = false;
        for s in self.streams.in_mask(b.streams) {
            any_capturing |= self.streams.capturing(ctx.vmm, s, tick);
        }
        if any_capturing {
            return Err(b);
        }
        // An event on each of its streams, covering its work up to the
        // free: the recorded streams' tell when the block may be freed for
        // good; its own stream's, when another stream reaches for the
        // block once it is vacated (its hazard is of the work up to the
        // free, and an event recorded only then would cover much more).
        for s in self.streams.in_mask(b.streams) {
            self.streams
                .note_free(ctx.vmm, s, tick, EventTiming::AtFree);
        }
        self.stats.allocated_bytes.decrease(b.size);
        self.stats.allocation.decrease(1);
        self.stats.requested_bytes.decrease(b.requested);
        self.remember_freed(ptr);
        self.held.insert(ptr, HeldFree { block: b, tick });
        Ok(())
    }

    /// [`Core::allocate_in`] while frees are held: first free for good the
    /// held blocks whose recorded work is known complete (unless `stream`
    /// captures); on running out of memory with frees still held, release
    /// them all behind their hazards and try once more.
    pub(super) fn allocate_releasing_held(
        &mut self,
        ctx: &Ctx<'_>,
        size: u64,
        stream: StreamId,
        kind: Option<Kind>,
    ) -> Result<Allocation, AllocError> {
        self.release_held_done(ctx, stream);
        if self.held.is_empty() {
            return self.allocate_once(ctx, size, stream, kind);
        }
        let last_oom = self.last_oom.clone();
        match self.allocate_once(ctx, size, stream, kind) {
            Err(AllocError::OutOfMemory(_)) => {
                // The first try's failure is not the request's: the retry
                // answers for it.
                self.stats.num_ooms = self.stats.num_ooms.saturating_sub(1);
                self.last_oom = last_oom;
                self.stats.num_alloc_retries += 1;
                self.release_held_forced(ctx);
                self.allocate_once(ctx, size, stream, kind)
            }
            other => other,
        }
    }

    /// Free for good the held blocks whose recorded streams' work up to
    /// their free is known complete, learning it first (one query per
    /// stream at most); nothing while `stream` captures a CUDA graph.
    fn release_held_done(&mut self, ctx: &Ctx<'_>, stream: StreamId) {
        // Asked at the allocation's own tick (the one `allocate_once` takes
        // next), so that what this learns of a stream, placement does not
        // ask again.
        let tick = self.tick + 1;
        let si = self.stream_index(stream);
        if self.streams.capturing(ctx.vmm, si, tick) {
            return;
        }
        // Oldest first: a stream found running holds every later free of
        // it too, which is then not asked about.
        let mut order: Vec<(u64, DevicePtr)> =
            self.held.iter().map(|(&ptr, h)| (h.tick, ptr)).collect();
        order.sort_unstable();
        let mut running = 0u64;
        let mut done: Vec<DevicePtr> = Vec::new();
        for (at, ptr) in order {
            let Some(h) = self.held.get(&ptr) else {
                continue;
            };
            let others = recorded(&h.block);
            if others & running != 0 {
                continue;
            }
            let mut complete = true;
            for s in self.streams.in_mask(others) {
                self.streams.learn(ctx.vmm, s, at, tick);
                if !self.streams.is_done(s, at) {
                    running |= Streams::bit(s);
                    complete = false;
                    break;
                }
            }
            if complete {
                done.push(ptr);
            }
        }
        done.sort_unstable();
        for ptr in done {
            if let Some(mut h) = self.held.remove(&ptr) {
                // Its recorded work is done: only its own stream's remains,
                // up to the free.
                h.block.streams = Streams::bit(h.block.stream);
                self.tick += 1;
                self.vacate_at(ctx, h.block, h.tick);
            }
        }
    }

    /// Release every held free with its recorded streams' hazards (memory
    /// pressure): counted in `num_recorded_frees_forced`.
    fn release_held_forced(&mut self, ctx: &Ctx<'_>) {
        let mut all: Vec<(DevicePtr, HeldFree)> = self.held.drain().collect();
        all.sort_unstable_by_key(|(ptr, _)| *ptr);
        for (_, h) in all {
            self.stats.num_recorded_frees_forced += 1;
            self.tick += 1;
            self.vacate_at(ctx, h.block, h.tick);
        }
    }

    /// `empty_cache`'s first step: complete every held free's recorded work
    /// (synchronising the streams still running it) and free the blocks for
    /// good. A stream that captures cannot be synchronised: the error is
    /// returned and its blocks stay held.
    pub(super) fn release_held_completing(&mut self, ctx: &Ctx<'_>) -> Result<(), AllocError> {
        if self.held.is_empty() {
            return Ok(());
        }
        self.tick += 1;
        let tick = self.tick;
        let mut ptrs: Vec<DevicePtr> = self.held.keys().copied().collect();
        ptrs.sort_unstable();
        for ptr in ptrs {
            let Some(h) = self.held.get(&ptr) else {
                continue;
            };
            let (others, at) = (recorded(&h.block), h.tick);
            for s in self.streams.in_mask(others) {
                self.streams.complete(ctx.vmm, s, at, tick)?;
            }
            if let Some(mut h) = self.held.remove(&ptr) {
                h.block.streams = Streams::bit(h.block.stream);
                self.tick += 1;
                self.vacate_at(ctx, h.block, h.tick);
            }
        }
        Ok(())
    }
}
