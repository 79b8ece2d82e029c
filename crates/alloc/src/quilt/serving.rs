//! The serving API of [`QuiltAllocator`]: growable buffers, tags, sleep and
//! wake, the offload tier, their policies and counters. Each feature's
//! state and operations live in `growable.rs`, `sleep.rs` and `offload.rs`;
//! see `docs/serving.md`.

use quilt_vmm::StreamId;

use super::allocator::QuiltAllocator;
use super::config::{MapAhead, OffloadTier, Recycle};
use super::growable::{GrowableId, GrowableInfo};
use super::offload::with_offload_tier;
use super::sleep::{SleepMode, SleepPages};
use super::stitch::Kind;
use crate::api::Allocation;
use crate::error::AllocError;
use crate::stats::ServingStats;

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
        let (id, ahead) = self.with(|l, ctx| {
            let id = l
                .growables
                .create(&mut l.core, ctx, max_bytes, stream, None)?;
            Ok((id, ctx.cfg.map_ahead))
        })?;
        self.ahead.after_growth(&self.shared, id, ahead);
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
        let (id, ahead) = self.with(|l, ctx| {
            let t = l.tags.index(tag);
            l.tags.check_awake(t)?;
            let id = l
                .growables
                .create(&mut l.core, ctx, max_bytes, stream, Some(t))?;
            Ok((id, ctx.cfg.map_ahead))
        })?;
        self.ahead.after_growth(&self.shared, id, ahead);
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
        let ahead = self.with(|l, ctx| {
            let tag = l.growables.get(id)?.tag;
            with_offload_tier(l.tier(), ctx, tag, |t, ctx| {
                t.growables.grow(t.core, ctx, id, bytes)
            })?;
            Ok(ctx.cfg.map_ahead)
        })?;
        self.ahead.after_growth(&self.shared, id, ahead);
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
        self.with(|l, ctx| l.growables.shrink(&mut l.core, ctx, id, bytes))
    }

    /// Note that buffer `id` is used on `stream` too (as `record_stream`):
    /// pages it gives up are reused elsewhere only after that stream's work.
    pub fn record_growable_stream(
        &self,
        id: GrowableId,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        self.with(|l, _| l.growables.record_stream(&mut l.core, id, stream))
    }

    /// What buffer `id` is now.
    pub fn growable_info(&self, id: GrowableId) -> Result<GrowableInfo, AllocError> {
        self.with(|l, _| {
            let tags = &l.tags;
            l.growables.info(&l.core, id, |t| tags.name(t).to_string())
        })
    }

    /// Release buffer `id`: its pages go back to the pool (unmapped when
    /// their work is known complete; otherwise retired, their pool pages
    /// carrying that work as a hazard) and its range is freed once nothing
    /// is mapped in it. The id is dead afterwards
    /// ([`AllocError::UnknownGrowable`]).
    pub fn release_growable(&self, id: GrowableId) -> Result<(), AllocError> {
        self.with(|l, ctx| l.growables.release(&mut l.core, ctx, id))
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
        self.with(|l, ctx| {
            let t = l.tags.index(tag);
            l.tags.check_awake(t)?;
            with_offload_tier(l.tier(), ctx, Some(t), |tier, ctx| {
                tier.core
                    .allocate_in(ctx, size, stream, Some(Kind::Isolated(t)))
            })
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
        self.with(|l, ctx| {
            l.tags
                .sleep(&mut l.core, &l.growables, ctx, tag, mode, pages)
        })
    }

    /// Wake `tag`: map pages again under its members, at the same addresses
    /// (taking free pool pages, growing the pool or reclaiming cached pages
    /// as an allocation does), and copy their contents back (offload). Out of
    /// memory is [`AllocError::OutOfMemory`] and leaves the tag asleep with
    /// its host copy intact. Driver calls: one `cuMemMap` per page, one
    /// `cuMemSetAccess` per contiguous run, one `cuMemcpyHtoD` per member.
    /// A tag that is awake is [`AllocError::TagState`].
    pub fn wake(&self, tag: &str) -> Result<(), AllocError> {
        self.with(|l, ctx| {
            let exclude = l.tags.lookup(tag);
            with_offload_tier(l.tier(), ctx, exclude, |t, ctx| {
                t.tags.wake(t.core, t.growables, ctx, tag)
            })
        })
    }

    /// True while `tag` sleeps ([`AllocError::TagState`] for an unknown tag).
    pub fn is_asleep(&self, tag: &str) -> Result<bool, AllocError> {
        self.with(|l, _| match l.tags.lookup(tag) {
            Some(t) => Ok(l.tags.is_asleep(t)),
            None => Err(AllocError::TagState {
                tag: tag.to_string(),
                reason: "unknown tag: no allocation or growable buffer ever carried it",
            }),
        })
    }

    /// Set what happens when a request would run out of memory (see
    /// [`OffloadTier`]; `Off` by default). The policy in force changes
    /// ([`QuiltAllocator::config`] returns it).
    pub fn set_offload_tier(&self, tier: OffloadTier) -> Result<(), AllocError> {
        self.update_policy(|c| c.offload_tier = tier)
    }

    /// Let the offload tier put `tag` to sleep when a request would
    /// otherwise run out of memory (`true`), or not (`false`, the default).
    /// The owner of an offloadable tag must check
    /// [`is_asleep`](QuiltAllocator::is_asleep) and `wake` it before its
    /// memory is used again.
    pub fn set_offloadable(&self, tag: &str, offloadable: bool) -> Result<(), AllocError> {
        self.with(|l, _| {
            let t = l.tags.index(tag);
            l.tags.set_offloadable(t, offloadable);
            Ok(())
        })
    }

    /// Bytes of host memory holding sleeping tags' contents.
    pub fn host_bytes(&self) -> u64 {
        self.with(|l, _| Ok(l.tags.host_bytes())).unwrap_or(0)
    }

    /// The map-ahead policy of growable buffers.
    pub fn map_ahead(&self) -> MapAhead {
        self.config().map_ahead
    }

    /// Set the map-ahead policy of growable buffers (see [`MapAhead`]),
    /// validated as [`super::QuiltConfig::validate`] does: refused with
    /// [`AllocError::InvalidConfig`] (`below_per_mille` above 1000),
    /// nothing changes.
    pub fn set_map_ahead(&self, policy: MapAhead) -> Result<(), AllocError> {
        self.update_policy(|c| c.map_ahead = policy)
    }

    /// Set what happens to released growable buffers' ranges (see
    /// [`Recycle`]); the policy in force changes.
    pub fn set_recycle(&self, policy: Recycle) -> Result<(), AllocError> {
        self.update_policy(|c| c.recycle = policy)
    }

    /// Counters of growable buffers and sleep/wake.
    pub fn serving_stats(&self) -> ServingStats {
        self.with(|l, _| {
            let (g, t) = (l.growables.counts, l.tags.counts);
            Ok(ServingStats {
                spare_pages_reclaimed: l.core.spare_pages_reclaimed,
                sleeps: t.sleeps,
                wakes: t.wakes,
                bytes_offloaded: t.bytes_offloaded,
                bytes_restored: t.bytes_restored,
                sleep_syncs: t.sleep_syncs,
                tier_offloads: t.tier_offloads,
                tier_rescues: t.tier_rescues,
                ..g
            })
        })
        .unwrap_or_default()
    }

    /// Map ahead of every live growable buffer now, on this thread, as the
    /// policy says (its pages and pressure bound, whatever its mode): the
    /// deterministic form of the background worker, for tests. Returns the
    /// pages mapped.
    pub fn map_ahead_now(&self) -> Result<u64, AllocError> {
        self.with(|l, ctx| {
            let mut ids: Vec<u64> = l.growables.live.keys().copied().collect();
            ids.sort_unstable();
            let mut n = 0;
            for id in ids {
                n += l.growables.map_ahead(&mut l.core, ctx, GrowableId(id))?;
            }
            Ok(n)
        })
    }

    /// Stop the map-ahead worker if it runs (it starts again on the next
    /// growth under [`super::AheadMode::Background`]); the allocator's drop
    /// does this too.
    pub fn stop_map_ahead_worker(&self) {
        self.ahead.stop();
    }
}
