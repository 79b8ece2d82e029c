//! The serving API of [`QuiltAllocator`]: growable buffers, tags, sleep and
//! wake, and their counters. The state's side lives in `growable.rs` and
//! `sleep.rs`; see `docs/serving.md`.

use quilt_vmm::StreamId;

use super::growable::{GrowableId, GrowableInfo, MapAhead, Recycle, ServingStats};
use super::offload::OffloadTier;
use super::sleep::{SleepMode, SleepPages};
use super::QuiltAllocator;
use crate::api::Allocation;
use crate::error::AllocError;

impl QuiltAllocator {
    /// Create a growable buffer of at most `max_bytes` (rounded up to whole
    /// pages) whose growth is ordered on `stream`. Reserves its virtual range
    /// (one `cuMemAddressReserve`), maps nothing: its length is 0 until
    /// [`grow_to`](QuiltAllocator::grow_to). Its address
    /// ([`GrowableInfo::ptr`]) never changes. Prefer the owning handle,
    /// [`super::GrowableBuffer`], which releases it when dropped.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let id = alloc.create_growable(256 << 20, StreamId::DEFAULT)?;
    /// let ptr = alloc.growable_info(id)?.ptr;
    /// alloc.grow_to(id, 5 << 20)?;          // maps 3 pages of 2 MiB
    /// alloc.grow_to(id, 100 << 20)?;        // same address, contents kept
    /// assert_eq!(alloc.growable_info(id)?.ptr, ptr);
    /// alloc.shrink_to(id, 1 << 20)?;        // pages left become spare
    /// assert!(alloc.grow_to(id, 1 << 30).is_err()); // beyond its maximum
    /// alloc.release_growable(id)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn create_growable(
        &self,
        max_bytes: u64,
        stream: StreamId,
    ) -> Result<GrowableId, AllocError> {
        let ctx = self.ctx();
        let (id, ahead) = {
            let mut st = self.lock()?;
            (
                st.growable_create(&ctx, max_bytes, stream, None)?,
                st.map_ahead,
            )
        };
        self.ahead.after_growth(&self.core, id, ahead);
        Ok(id)
    }

    /// [`create_growable`](QuiltAllocator::create_growable) with a tag: the
    /// buffer sleeps and wakes with the tag ([`QuiltAllocator::sleep`]).
    /// Refused while the tag is asleep.
    pub fn create_growable_tagged(
        &self,
        max_bytes: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<GrowableId, AllocError> {
        let ctx = self.ctx();
        let (id, ahead) = {
            let mut st = self.lock()?;
            let t = st.tags.index(tag);
            (
                st.growable_create(&ctx, max_bytes, stream, Some(t))?,
                st.map_ahead,
            )
        };
        self.ahead.after_growth(&self.core, id, ahead);
        Ok(id)
    }

    /// Grow buffer `id` to `bytes` (at most its maximum; `bytes` below its
    /// length is [`AllocError::InvalidResize`], equal is a no-op). The pages
    /// it reaches that are not mapped yet are backed from the pool (growing
    /// it, or reclaiming cached pages, as an allocation does), ordered after
    /// any other stream's work on them; pages mapped ahead cost no driver
    /// call. Its address and its contents do not move. Out of memory is
    /// [`AllocError::OutOfMemory`] with the usual report and leaves the
    /// buffer as it was.
    pub fn grow_to(&self, id: GrowableId, bytes: u64) -> Result<(), AllocError> {
        let ctx = self.ctx();
        let ahead = {
            let mut st = self.lock()?;
            let tag = st.growable(id)?.tag;
            st.with_offload_tier(&ctx, tag, |st, ctx| st.growable_grow(ctx, id, bytes))?;
            st.map_ahead
        };
        self.ahead.after_growth(&self.core, id, ahead);
        Ok(())
    }

    /// Shrink buffer `id` to `bytes` (`bytes` above its length is
    /// [`AllocError::InvalidResize`], equal is a no-op). Its address and the
    /// contents below `bytes` do not move. The pages it leaves stay mapped
    /// as spare pages, with the buffer's streams' work as their hazard (a
    /// later user on another stream waits for it; nothing synchronises):
    /// up to [`MapAhead::pages`] of them serve its next growth; the others
    /// are unmapped at once when their work is known complete, and are the
    /// first pages reclaimed otherwise, so ordinary allocations reuse them.
    pub fn shrink_to(&self, id: GrowableId, bytes: u64) -> Result<(), AllocError> {
        let ctx = self.ctx();
        self.lock()?.growable_shrink(&ctx, id, bytes)
    }

    /// Note that buffer `id` is used on `stream` too (as `record_stream`):
    /// pages it gives up are reused elsewhere only after that stream's work.
    pub fn record_growable_stream(
        &self,
        id: GrowableId,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        self.lock()?.growable_record_stream(id, stream)
    }

    /// What buffer `id` is now.
    pub fn growable_info(&self, id: GrowableId) -> Result<GrowableInfo, AllocError> {
        self.lock()?.growable_info(id)
    }

    /// Release buffer `id`: its pages go back to the pool (unmapped when
    /// their work is known complete; otherwise retired, their pool pages
    /// carrying that work as a hazard) and its range is freed once nothing
    /// is mapped in it. The id is dead afterwards
    /// ([`AllocError::UnknownGrowable`]).
    pub fn release_growable(&self, id: GrowableId) -> Result<(), AllocError> {
        let ctx = self.ctx();
        self.lock()?.growable_release(&ctx, id)
    }

    /// Allocate `size` bytes on `stream` carrying `tag`: the block lives in
    /// the tag's own arena (its pages are never shared with untagged blocks
    /// or other tags), and sleeps and wakes with the tag
    /// ([`QuiltAllocator::sleep`]). Free it with
    /// [`DeviceAllocator::free`](crate::DeviceAllocator::free) as any block.
    /// Refused while the tag is asleep ([`AllocError::TagState`]).
    pub fn allocate_tagged(
        &self,
        size: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<Allocation, AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        let t = st.tags.index(tag);
        st.with_offload_tier(&ctx, Some(t), |st, ctx| {
            st.allocate_in(ctx, size, stream, Some(t))
        })
    }

    /// Put every member of `tag` to sleep: the streams that used them are
    /// synchronised, their contents copied to host memory
    /// ([`SleepMode::Offload`]) or dropped ([`SleepMode::Discard`]), and
    /// their pages unmapped and returned to the pool (free pool pages,
    /// usable by any allocation; [`QuiltAllocator::sleep_with`] can release
    /// them to the device instead). Their addresses stay reserved and
    /// their blocks live. Driver calls: one `cuStreamSynchronize` per stream
    /// with work not known complete, one `cuMemcpyDtoH` per member
    /// (offload), one `cuMemUnmap` per page. An unknown tag, or one already
    /// asleep, is [`AllocError::TagState`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig, SleepMode};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let weights = alloc.allocate_tagged(300 << 20, StreamId::DEFAULT, "weights")?;
    /// alloc.sleep("weights", SleepMode::Offload)?;
    /// assert!(alloc.is_asleep("weights")?);
    /// let other = alloc.allocate(300 << 20, StreamId::DEFAULT)?; // the same pages
    /// alloc.free(other.ptr)?;
    /// alloc.wake("weights")?; // same address, bytes copied back
    /// alloc.free(weights.ptr)?;
    /// alloc.check_invariants()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn sleep(&self, tag: &str, mode: SleepMode) -> Result<(), AllocError> {
        self.sleep_with(tag, mode, SleepPages::KeepInPool)
    }

    /// [`sleep`](QuiltAllocator::sleep), choosing where the pages go: kept
    /// in the pool, or released to the device (one `cuMemRelease` per page,
    /// so that other programs can use the memory; the wake creates them
    /// again with `cuMemCreate`).
    pub fn sleep_with(
        &self,
        tag: &str,
        mode: SleepMode,
        pages: SleepPages,
    ) -> Result<(), AllocError> {
        let ctx = self.ctx();
        self.lock()?.sleep(&ctx, tag, mode, pages)
    }

    /// Wake `tag`: map pages again under its members, at the same addresses
    /// (taking free pool pages, growing the pool or reclaiming cached pages
    /// as an allocation does), and copy their contents back (offload). Out of
    /// memory is [`AllocError::OutOfMemory`] and leaves the tag asleep with
    /// its host copy intact. Driver calls: one `cuMemMap` per page, one
    /// `cuMemSetAccess` per contiguous run, one `cuMemcpyHtoD` per member.
    /// A tag that is awake is [`AllocError::TagState`].
    pub fn wake(&self, tag: &str) -> Result<(), AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        let exclude = st.tags.lookup(tag);
        st.with_offload_tier(&ctx, exclude, |st, ctx| st.wake(ctx, tag))
    }

    /// True while `tag` sleeps ([`AllocError::TagState`] for an unknown tag).
    pub fn is_asleep(&self, tag: &str) -> Result<bool, AllocError> {
        let st = self.lock()?;
        let known = st.tags.lookup(tag);
        match known {
            Some(t) => Ok(st.tags.is_asleep(t)),
            None => Err(AllocError::TagState {
                tag: tag.to_string(),
                reason: "unknown tag: no allocation or growable buffer ever carried it",
            }),
        }
    }

    /// Set what happens when a request would run out of memory (see
    /// [`OffloadTier`]; `Off` by default).
    pub fn set_offload_tier(&self, tier: OffloadTier) -> Result<(), AllocError> {
        self.lock()?.offload_tier = tier;
        Ok(())
    }

    /// Let the offload tier put `tag` to sleep when a request would
    /// otherwise run out of memory (`true`), or not (`false`, the default).
    /// The owner of an offloadable tag must check
    /// [`is_asleep`](QuiltAllocator::is_asleep) and `wake` it before its
    /// memory is used again.
    pub fn set_offloadable(&self, tag: &str, offloadable: bool) -> Result<(), AllocError> {
        let mut st = self.lock()?;
        let t = st.tags.index(tag);
        st.tags.set_offloadable(t, offloadable);
        Ok(())
    }

    /// Bytes of host memory holding sleeping tags' contents.
    pub fn host_bytes(&self) -> u64 {
        self.lock().map(|s| s.tags.host_bytes()).unwrap_or(0)
    }

    /// The map-ahead policy of growable buffers.
    pub fn map_ahead(&self) -> MapAhead {
        self.lock().map(|s| s.map_ahead).unwrap_or(MapAhead::OFF)
    }

    /// Set the map-ahead policy of growable buffers (see [`MapAhead`]).
    pub fn set_map_ahead(&self, policy: MapAhead) -> Result<(), AllocError> {
        self.lock()?.map_ahead = policy;
        Ok(())
    }

    /// Set what happens to released growable buffers' ranges (see [`Recycle`]).
    pub fn set_recycle(&self, policy: Recycle) -> Result<(), AllocError> {
        self.lock()?.recycle = policy;
        Ok(())
    }

    /// Counters of growable buffers and sleep/wake.
    pub fn serving_stats(&self) -> ServingStats {
        self.lock().map(|s| s.serving).unwrap_or_default()
    }

    /// Map ahead of every live growable buffer now, on this thread, as the
    /// policy says (its pages and pressure bound, whatever its mode): the
    /// deterministic form of the background worker, for tests. Returns the
    /// pages mapped.
    pub fn map_ahead_now(&self) -> Result<u64, AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        let mut ids: Vec<u64> = st.growables.keys().copied().collect();
        ids.sort_unstable();
        let mut n = 0;
        for id in ids {
            n += st.map_ahead_for(&ctx, GrowableId(id))?;
        }
        Ok(n)
    }

    /// Stop the map-ahead worker if it runs (it starts again on the next
    /// growth under [`super::AheadMode::Background`]); the allocator's drop
    /// does this too.
    pub fn stop_map_ahead_worker(&self) {
        self.ahead.stop();
    }
}
