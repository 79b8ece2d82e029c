//! # Quilt: the stitching allocator
//!
//! Virtual arenas (one shared by every stream by default), each a generous
//! reservation of address space carved at 512-byte granularity. A block goes
//! into one of the best-fitting free gaps of its arena, at the gap's start,
//! next to the block before it: neighbours share their boundary pages, so a
//! run of 2.25 MiB tensors packs at 2.25 MiB each. The pages behind a block
//! come from the physical page pool (`quilt-pool`), from wherever it has them:
//! every page is one driver handle, mapped whole at offset 0 with its own
//! `cuMemMap`; one `cuMemSetAccess` covers each newly mapped contiguous range.
//!
//! A freed block's pages stay mapped (cached): the next block placed over them
//! costs no driver call. Since every mapping is one page, any cached page can
//! be unmapped alone, and no page under a live block is ever unmapped.
//!
//! Streams: a block freed on one stream may be reused on another once the
//! freeing stream's work is known complete (an event it recorded has
//! completed), or after the new stream waits for that work (one
//! `cuStreamWaitEvent`, at most once per pair of streams for any span of
//! frees). Placement prefers ranges that need no wait and no new page.
//!
//! Streams the allocator no longer may name (their owner destroys them) are
//! forgotten ([`QuiltAllocator::forget_stream`]). Under stream capture (CUDA
//! graphs) it makes only the calls relaxed capture mode permits, and a
//! block freed while one of its streams captures is not reused until the
//! capture ends (see `streams.rs`). At drop, every stream is synchronised
//! before anything is unmapped.
//!
//! When the pool cannot grow, cached pages are unmapped and returned to the
//! pool, after synchronising only the streams whose work may still use them.
//! A request of `N` new pages fails only when fewer than `N` pages are free,
//! cached or creatable: the out-of-memory is capacity, never fragmentation.
//!
//! See `docs/design.md` for the data structures and the invariants, and
//! `docs/benchmarks.md` for the figures.

mod ahead;
mod arena;
mod backing;
mod config;
mod export;
mod growable;
mod growable_buffer;
mod invariants;
mod offload;
mod placement;
mod reclaim;
mod serving;
mod sleep;
mod snapshot;
mod state;
mod streams;
mod tiling;

use std::sync::{Arc, Mutex, MutexGuard};

use quilt_pool::PagePool;
use quilt_vmm::{DevicePtr, StreamId, Vmm};

pub use config::{
    AccessGranularity, ArenaLayout, ArenaSharing, Placement, QuiltConfig, ReclaimPolicy,
    SmallBlocks,
};
pub use growable::{AheadMode, GrowableId, GrowableInfo, MapAhead, Recycle, ServingStats};
pub use growable_buffer::GrowableBuffer;
pub use offload::OffloadTier;
pub use quilt_pool::{GrowthPolicy, MemoryLimit, PageSize, PoolConfig};
pub use sleep::{SleepMode, SleepPages};

use crate::api::{Allocation, DeviceAllocator};
use crate::error::{AllocError, InvariantViolation};
use crate::snapshot::MemorySnapshot;
use crate::stats::AllocatorStats;
use state::{pool_err, Ctx, State};

/// The Quilt allocator for one device. `Send + Sync`: one lock guards its state.
#[derive(Debug)]
pub struct QuiltAllocator {
    core: Arc<Core>,
    /// The map-ahead worker of growable buffers (started on first use).
    ahead: ahead::Worker,
}

/// What the allocator and its map-ahead worker share: the worker holds a
/// `Weak` of it, so dropping the allocator stops the worker.
#[derive(Debug)]
pub(crate) struct Core {
    vmm: Arc<dyn Vmm>,
    pool: PagePool,
    config: QuiltConfig,
    page: u64,
    arena_va: u64,
    name: &'static str,
    state: Mutex<State>,
    /// Blocks exported to other processes (`export.rs`).
    exports: export::ExportRegistry,
}

impl Core {
    fn lock(&self) -> Result<MutexGuard<'_, State>, AllocError> {
        self.state.lock().map_err(|_| AllocError::Poisoned)
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            vmm: self.vmm.as_ref(),
            pool: &self.pool,
            cfg: &self.config,
            page: self.page,
            arena_va: self.arena_va,
            name: self.name,
        }
    }
}

impl QuiltAllocator {
    /// An allocator over `vmm` with `config`. Holds no memory until the first request.
    /// Fails with [`AllocError::InvalidConfig`] for a configuration that
    /// breaks a promise ([`QuiltConfig::validate`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(80 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let block = alloc.allocate(300 << 20, StreamId::DEFAULT)?;
    /// assert!(block.size >= 300 << 20);
    /// alloc.free(block.ptr)?;
    /// alloc.check_invariants()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(vmm: Arc<dyn Vmm>, config: QuiltConfig) -> Result<QuiltAllocator, AllocError> {
        config.validate()?;
        let pool = PagePool::new(vmm.clone(), config.pool).map_err(pool_err)?;
        let page = pool.page_size();
        // Sized from the device, not the limit: any limit up to the
        // device's size is honoured without a new reservation.
        let device = pool.device_total().div_ceil(page).max(1) * page;
        let arena_va = device.saturating_mul(config.layout.va_factor.max(1));
        let core = Arc::new(Core {
            vmm,
            pool,
            config,
            page,
            arena_va,
            name: config.name,
            state: Mutex::new(State::with_serving_policies(&config)),
            exports: export::ExportRegistry::default(),
        });
        Ok(QuiltAllocator {
            core,
            ahead: ahead::Worker::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &QuiltConfig {
        &self.core.config
    }

    /// The physical page pool's figures: pages held and free, the page
    /// size, the memory limit.
    pub fn pool_stats(&self) -> quilt_pool::PoolStats {
        self.core.pool.stats()
    }

    /// Change the memory limit (resolved against the device's total
    /// memory), under the allocator's lock. Raising it is always honoured:
    /// arenas are sized from the device, not the limit. Lowering it below
    /// what the pool holds first returns cached and free pages to the
    /// device (synchronising only the streams whose work may still use
    /// them, as [`DeviceAllocator::empty_cache`] does); if live blocks
    /// still hold more than the new limit, it fails with
    /// [`AllocError::Pool`] (`LimitBelowHeld`) and the limit stays as it
    /// was. Returns the limit now in force, in bytes.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_alloc::quilt::{MemoryLimit, PoolConfig, QuiltAllocator, QuiltConfig};
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(8 << 30)?);
    /// let config = QuiltConfig {
    ///     pool: PoolConfig { limit: MemoryLimit::Fraction(0.03), ..QuiltConfig::default().pool },
    ///     ..QuiltConfig::default()
    /// };
    /// let alloc = QuiltAllocator::new(vmm, config)?;
    /// assert!(alloc.allocate(3 << 30, StreamId::DEFAULT).is_err());
    /// alloc.set_memory_limit(MemoryLimit::Fraction(1.0))?;
    /// let big = alloc.allocate(3 << 30, StreamId::DEFAULT)?;
    /// # alloc.free(big.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_memory_limit(&self, limit: MemoryLimit) -> Result<u64, AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        st.set_memory_limit(&ctx, limit)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, AllocError> {
        self.core.lock()
    }

    fn ctx(&self) -> Ctx<'_> {
        self.core.ctx()
    }

    /// Pages that are mapped but back no block (the cache), over all arenas.
    pub fn cached_bytes(&self) -> u64 {
        self.lock()
            .map(|s| s.cached_pages() * self.core.page)
            .unwrap_or(0)
    }

    /// The memory as the GPU sees it: one segment per maximal run of mapped
    /// pages, tiled exactly by live blocks (`Active`) and free pieces
    /// (`Inactive`); the segments add up to the mapped bytes, which with the
    /// pool's free pages make the reserved bytes. (The trait's
    /// [`DeviceAllocator::snapshot`] shows one segment per arena instead, with
    /// its unmapped gaps.)
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let a = alloc.allocate(5 << 20, StreamId::DEFAULT)?;
    /// let snap = alloc.mapped_segments();
    /// let shown: u64 = snap.segments.iter().map(|s| s.total_size).sum();
    /// let free_pool = alloc.pool().free_pages() * alloc.pool().page_size();
    /// assert_eq!(shown + free_pool, alloc.stats().reserved_bytes.current);
    /// # alloc.free(a.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn mapped_segments(&self) -> MemorySnapshot {
        match self.lock() {
            Ok(st) => snapshot::mapped_segments(&st, self.core.name, self.core.page),
            Err(_) => MemorySnapshot {
                allocator: self.core.name.to_string(),
                segments: Vec::new(),
            },
        }
    }

    /// Forget `stream`: its owner is about to destroy it (a cudarc
    /// `CudaStream` dropped, a `torch.cuda.Stream` collected). The stream
    /// is synchronised once (its work on any block is then complete), its
    /// pending events are retired, blocks cached with hazards of it become
    /// plain free memory, and the backend forgets its handle
    /// ([`Vmm::forget_stream`]): no later driver call names it. A later
    /// request naming the same [`StreamId`] (a new stream the driver gave
    /// the same handle) is a new stream. Blocks still live that were used
    /// on it stay live; their free makes no call on it.
    ///
    /// Errors ([`AllocError::StreamBusy`], nothing changed): the default
    /// stream; a stream that is capturing a CUDA graph; a stream a live
    /// growable buffer grows on. A failed synchronisation is
    /// [`AllocError::Driver`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let a = alloc.allocate(4 << 20, StreamId(7))?;
    /// alloc.free(a.ptr)?;
    /// alloc.forget_stream(StreamId(7))?; // before its owner destroys it
    /// let b = alloc.allocate(4 << 20, StreamId(8))?; // no wait on stream 7
    /// # alloc.free(b.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forget_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        let ctx = self.ctx();
        self.lock()?.forget_stream(&ctx, stream)
    }

    /// Pages touched by at least one live block, over all arenas, in bytes:
    /// the physical memory blocks hold.
    pub fn touched_bytes(&self) -> u64 {
        self.lock()
            .map(|s| s.arenas.iter().map(|a| a.touched_pages).sum::<u64>() * self.core.page)
            .unwrap_or(0)
    }
}

impl DeviceAllocator for QuiltAllocator {
    fn name(&self) -> &str {
        self.core.name
    }

    fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let ctx = self.ctx();
        self.lock()?
            .with_offload_tier(&ctx, None, |st, ctx| st.allocate(ctx, size, stream))
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        if self.core.exports.on_free(ptr)? == export::FreeOfPinned::Deferred {
            return Ok(()); // exported: freed at the last `end_export`
        }
        st.free(&ctx, ptr)
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let mut st = self.lock()?;
        self.core.exports.check_not_freed(ptr)?;
        st.record_stream(ptr, stream)
    }

    fn forget_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        QuiltAllocator::forget_stream(self, stream)
    }

    fn empty_cache(&self) -> Result<(), AllocError> {
        let ctx = self.ctx();
        self.lock()?.empty_cache(&ctx)
    }

    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        st.sync_stats(&ctx);
        st.stats.reset_peaks();
        Ok(())
    }

    fn stats(&self) -> AllocatorStats {
        let ctx = self.ctx();
        let mut s = match self.lock() {
            Ok(mut st) => {
                st.sync_stats(&ctx);
                st.stats.clone()
            }
            Err(_) => AllocatorStats::default(),
        };
        s.driver = self.core.vmm.driver_stats();
        s
    }

    fn snapshot(&self) -> MemorySnapshot {
        match self.lock() {
            Ok(st) => snapshot::snapshot(&st, self.core.name, self.core.page),
            Err(_) => MemorySnapshot {
                allocator: self.core.name.to_string(),
                segments: Vec::new(),
            },
        }
    }

    fn gpu_segments(&self) -> MemorySnapshot {
        self.mapped_segments()
    }

    fn last_oom(&self) -> Option<crate::error::OomReport> {
        self.lock().ok().and_then(|st| st.last_oom.clone())
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let st = self.lock().map_err(|e| InvariantViolation(e.to_string()))?;
        invariants::check(&st, &self.core.pool, self.core.page)?;
        self.core.exports.check(&st)
    }

    fn vmm(&self) -> &Arc<dyn Vmm> {
        &self.core.vmm
    }
}

impl Drop for QuiltAllocator {
    fn drop(&mut self) {
        self.ahead.stop();
        let page = self.core.page;
        let mut guard = match self.core.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        let state = &mut *guard;
        if !state.blocks.is_empty() {
            tracing::warn!(
                live = state.blocks.len(),
                "quilt allocator dropped with live allocations; releasing their memory"
            );
        }
        // No unmap or release while work that may use the memory is not
        // known complete: synchronise every stream first, as PyTorch's
        // expandable segments do before unmapping (`cuMemUnmap` and
        // `cuMemRelease` "do not appear to synchronize in all cases").
        state.tick += 1;
        let tick = state.tick;
        state.streams.synchronize_all(self.core.vmm.as_ref(), tick);
        state.streams.destroy_events(self.core.vmm.as_ref());
        let mut give = Vec::new();
        for a in &mut state.arenas {
            if a.size == 0 {
                continue; // a released growable buffer's slot: nothing held
            }
            for p in 0..a.pages.len() as u64 {
                let slot = a.slot(p);
                if slot.phys.is_none() && !slot.retired {
                    continue;
                }
                match self.core.vmm.unmap(a.page_addr(p), page) {
                    Ok(()) if slot.retired => a.clear_retired(p),
                    Ok(()) => give.extend(a.set_unmapped(p)),
                    Err(e) => tracing::warn!(error = %e, "unmap at drop failed"),
                }
            }
            if let Err(e) = self.core.vmm.address_free(a.base, a.size) {
                tracing::warn!(error = %e, "address free at drop failed");
            }
        }
        if let Err(e) = self.core.pool.give_back(&give) {
            tracing::warn!(error = %e, "returning pages to the pool at drop failed");
        }
        if let Err(e) = self.core.pool.trim(0) {
            tracing::warn!(error = %e, "releasing pages at drop failed");
        }
    }
}
