//! The allocator: one lock over the stitching core, the features and the
//! policy in force, and the `DeviceAllocator` interface on top.

use std::sync::{Arc, Mutex, MutexGuard};

use quilt_pool::{MemoryLimit, PagePool, PoolStats};
use quilt_vmm::{DevicePtr, HandleKind, StreamId, Vmm};

use super::ahead;
use super::config::QuiltConfig;
use super::export::Exports;
use super::growable::Growables;
#[cfg(feature = "invariants")]
use super::invariants;
use super::offload::{with_offload_tier, Tier};
use super::segments;
use super::sleep::Tags;
use super::stitch::{pool_err, Core, Ctx, Kind};
use crate::api::{Allocation, DeviceAllocator};
use crate::baselines::RoundupPower2Divisions;
use crate::error::AllocError;
#[cfg(feature = "invariants")]
use crate::error::InvariantViolation;
use crate::ipc::ExportedAllocation;
use crate::snapshot::MemorySnapshot;
use crate::stats::AllocatorStats;

/// The Quilt allocator for one device. `Send + Sync`: one lock guards its state.
///
/// Made from a driver backend and a [`QuiltConfig`]; used through
/// [`DeviceAllocator`] (allocate, free, `record_stream`, statistics, the
/// out-of-memory report) and its own methods (the pool's figures, the
/// memory limit, growable buffers, tags that sleep and wake, export). On
/// the host backend its memory is real memory of this process:
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::DeviceAllocator;
/// use quilt_vmm::host::{HostConfig, HostVmm};
/// use quilt_vmm::{StreamId, Vmm};
///
/// // The host backend: memory of this process under CUDA's rules (Linux).
/// let vmm: Arc<dyn Vmm> = Arc::new(HostVmm::new(HostConfig::default())?);
/// let alloc = QuiltAllocator::new(vmm.clone(), QuiltConfig::default())?;
/// let a = alloc.allocate(5 << 20, StreamId(1))?;
/// let b = alloc.allocate(5 << 20, StreamId(2))?;
/// // A block is one contiguous range, whichever pages back it.
/// let data = vec![7u8; 5 << 20];
/// vmm.copy_from_host(a.ptr, &data)?;
/// let mut back = vec![0u8; 5 << 20];
/// vmm.copy_to_host(a.ptr, &mut back)?;
/// assert_eq!(back, data);
/// alloc.free(a.ptr)?;
/// alloc.free(b.ptr)?;
/// assert!(alloc.cached_bytes() > 0, "freed pages stay mapped, cached");
/// alloc.empty_cache()?; // and go back to the device
/// assert_eq!(alloc.pool_stats().held_bytes, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct QuiltAllocator {
    pub(super) shared: Arc<Shared>,
    /// The map-ahead worker of growable buffers (started on first use).
    pub(super) ahead: ahead::Worker,
}

/// A live block as [`QuiltAllocator::block`] and
/// [`QuiltAllocator::free_owned`] describe it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    /// The bytes it covers (the rounded size).
    pub size: u64,
    /// The bytes asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: StreamId,
}

/// What the allocator and its map-ahead worker share: the worker holds a
/// `Weak` of it, so dropping the allocator stops the worker.
#[derive(Debug)]
pub(crate) struct Shared {
    vmm: Arc<dyn Vmm>,
    pool: PagePool,
    page: u64,
    arena_va: u64,
    name: &'static str,
    state: Mutex<Locked>,
}

/// Everything the one lock guards: the policy in force and the state the
/// operations work on.
#[derive(Debug)]
pub(crate) struct Locked {
    /// The policy in force: validated whole at every change.
    pub(crate) policy: QuiltConfig,
    pub(crate) state: State,
}

/// The stitching core and each feature's own state: what an operation
/// under the lock changes, the policy in force beside it read-only.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) core: Core,
    pub(crate) growables: Growables,
    pub(crate) tags: Tags,
    pub(crate) exports: Exports,
}

impl State {
    /// The core and the features the offload tier works on.
    pub(crate) fn tier(&mut self) -> Tier<'_> {
        Tier {
            core: &mut self.core,
            growables: &mut self.growables,
            tags: &mut self.tags,
        }
    }
}

impl Shared {
    pub(super) fn lock(&self) -> Result<MutexGuard<'_, Locked>, AllocError> {
        self.state.lock().map_err(|_| AllocError::Poisoned)
    }

    /// What the core's algorithms need besides its state, under `policy`.
    pub(super) fn ctx<'a>(&'a self, policy: &'a QuiltConfig) -> Ctx<'a> {
        Ctx {
            vmm: self.vmm.as_ref(),
            pool: &self.pool,
            cfg: policy,
            page: self.page,
            arena_va: self.arena_va,
            name: self.name,
        }
    }

    /// Run `op` under the lock with the policy in force (read where it
    /// lies: `op` changes the state, never the policy).
    pub(super) fn with<T>(
        &self,
        op: impl FnOnce(&mut State, &Ctx<'_>) -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        let mut guard = self.lock()?;
        let Locked { policy, state } = &mut *guard;
        let ctx = self.ctx(policy);
        op(state, &ctx)
    }
}

impl ahead::MapsAhead for Shared {
    fn map_ahead(&self, id: super::growable::GrowableId) {
        let result = self.with(|l, ctx| l.growables.map_ahead(&mut l.core, ctx, id));
        if let Err(e) = result {
            tracing::debug!(error = %e, id = id.0, "mapping ahead failed");
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
        let shared = Arc::new(Shared {
            vmm,
            pool,
            page,
            arena_va,
            name: config.name,
            state: Mutex::new(Locked {
                policy: config,
                state: State {
                    core: Core::default(),
                    growables: Growables::default(),
                    tags: Tags::default(),
                    exports: Exports::default(),
                },
            }),
        });
        Ok(QuiltAllocator {
            shared,
            ahead: ahead::Worker::default(),
        })
    }

    pub(super) fn with<T>(
        &self,
        op: impl FnOnce(&mut State, &Ctx<'_>) -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        self.shared.with(op)
    }

    /// The configuration in force: the one given to [`QuiltAllocator::new`]
    /// with the changes made since (`set_map_ahead`, `set_recycle`,
    /// `set_offload_tier`, [`QuiltAllocator::set_memory_limit`]).
    pub fn config(&self) -> QuiltConfig {
        match self.shared.state.lock() {
            Ok(l) => l.policy,
            Err(p) => p.into_inner().policy,
        }
    }

    /// Change the policy in force with `change`, validated whole
    /// ([`QuiltConfig::validate`]): refused with
    /// [`AllocError::InvalidConfig`], nothing changes.
    pub(super) fn update_policy(
        &self,
        change: impl FnOnce(&mut QuiltConfig),
    ) -> Result<(), AllocError> {
        let mut l = self.shared.lock()?;
        let mut policy = l.policy;
        change(&mut policy);
        policy.validate()?;
        l.policy = policy;
        Ok(())
    }

    /// The physical page pool's figures: pages held and free, the page
    /// size, the memory limit.
    pub fn pool_stats(&self) -> PoolStats {
        self.shared.pool.stats()
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
        let mut guard = self.shared.lock()?;
        let Locked { policy, state } = &mut *guard;
        let bytes = state
            .core
            .set_memory_limit(&self.shared.ctx(policy), limit)?;
        policy.pool.limit = limit;
        Ok(bytes)
    }

    /// Pages that are mapped but back no block (the cache), over all arenas.
    pub fn cached_bytes(&self) -> u64 {
        self.shared
            .lock()
            .map(|l| l.state.core.cached_pages() * self.shared.page)
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
    /// let pool = alloc.pool_stats();
    /// let free_pool = pool.free_pages * pool.page_size;
    /// assert_eq!(shown + free_pool, alloc.stats().reserved_bytes.current);
    /// # alloc.free(a.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn mapped_segments(&self) -> MemorySnapshot {
        match self.shared.lock() {
            Ok(l) => segments::mapped_segments(&l.state.core, self.shared.name, self.shared.page),
            Err(_) => MemorySnapshot {
                allocator: self.shared.name.to_string(),
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
        self.with(|l, ctx| {
            if let Some(i) = l.core.streams.find(stream) {
                if l.growables.grows_on(i) {
                    return Err(AllocError::StreamBusy {
                        stream: stream.0,
                        reason: "a live growable buffer grows on it: release the buffer first",
                    });
                }
            }
            l.core.forget_stream(ctx, stream)
        })
    }

    /// Round every later request as PyTorch's `roundup_power2_divisions`
    /// setting does ([`RoundupPower2Divisions`]; PyTorch's own rule,
    /// `round_size`): a block of the rounded size, its requested bytes those
    /// asked for. [`RoundupPower2Divisions::OFF`] (the default) rounds to
    /// blocks only. A bucket neither 0 nor a power of two is an error, and
    /// nothing changes.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::baselines::RoundupPower2Divisions;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// alloc.set_roundup_power2_divisions(RoundupPower2Divisions::uniform(4))?;
    /// let a = alloc.allocate(84 << 20, StreamId::DEFAULT)?; // 64 MiB + 4 steps of 8 MiB
    /// assert_eq!(a.size, 96 << 20);
    /// assert_eq!(alloc.stats().requested_bytes.current, 84 << 20);
    /// assert!(alloc.set_roundup_power2_divisions(RoundupPower2Divisions::uniform(3)).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_roundup_power2_divisions(
        &self,
        divisions: RoundupPower2Divisions,
    ) -> Result<(), AllocError> {
        divisions.validate()?;
        self.with(|l, _| {
            l.core.roundup = divisions;
            Ok(())
        })
    }

    /// [`DeviceAllocator::allocate`] in the arena of blocks kept apart: its
    /// pages are never shared with the blocks of the small and large arenas
    /// (nor of tags), so that memory set aside for one user (torch's
    /// private pools' segments) never lies between theirs. Free it with
    /// [`DeviceAllocator::free`] as any block.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let a = alloc.allocate(1 << 20, StreamId::DEFAULT)?;
    /// let apart = alloc.allocate_apart(2 << 20, StreamId::DEFAULT)?;
    /// let b = alloc.allocate(1 << 20, StreamId::DEFAULT)?;
    /// let kinds: Vec<_> = alloc.snapshot().segments.iter().map(|s| s.kind).collect();
    /// assert_eq!(kinds.iter().filter(|k| **k == "apart").count(), 1);
    /// let apart_range = apart.ptr..apart.ptr + apart.size;
    /// assert!(!apart_range.contains(&a.ptr) && !apart_range.contains(&b.ptr));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn allocate_apart(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.with(|l, ctx| {
            with_offload_tier(l.tier(), ctx, None, |t, ctx| {
                t.core.allocate_in(ctx, size, stream, Some(Kind::Apart))
            })
        })
    }

    /// The live block at `ptr`, if there is one (a hash lookup under the
    /// lock; `None` for any other pointer, without building an error).
    pub fn block(&self, ptr: DevicePtr) -> Option<LiveBlock> {
        let l = self.shared.lock().ok()?;
        let core = &l.state.core;
        core.blocks.get(&ptr).map(|b| LiveBlock {
            size: b.size,
            requested: b.requested,
            stream: core.streams.id(b.stream),
        })
    }

    /// [`DeviceAllocator::free`] of `ptr` when it is a live block of this
    /// allocator, saying what the block was; `Ok(None)`, nothing changed
    /// and no error built, when it is not one (for a caller with one
    /// allocator per device that asks each in turn; [`DeviceAllocator::free`]
    /// then tells a double free from an unknown pointer). One lock, one
    /// lookup more than `free`'s own.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{LiveBlock, QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let a = alloc.allocate(1000, StreamId(7))?;
    /// let freed = alloc.free_owned(a.ptr)?;
    /// assert_eq!(freed, Some(LiveBlock { size: a.size, requested: 1000, stream: StreamId(7) }));
    /// assert_eq!(alloc.free_owned(a.ptr)?, None); // freed already: not live
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn free_owned(&self, ptr: DevicePtr) -> Result<Option<LiveBlock>, AllocError> {
        self.with(|l, ctx| {
            let Some(b) = l.core.blocks.get(&ptr) else {
                return Ok(None);
            };
            let block = LiveBlock {
                size: b.size,
                requested: b.requested,
                stream: l.core.streams.id(b.stream),
            };
            if !l.exports.defers_free(ptr)? {
                l.core.free(ctx, ptr)?;
            }
            Ok(Some(block))
        })
    }

    /// Pages touched by at least one live block, over all arenas, in bytes:
    /// the physical memory blocks hold.
    pub fn touched_bytes(&self) -> u64 {
        self.shared
            .lock()
            .map(|l| {
                l.state
                    .core
                    .arenas
                    .iter()
                    .map(|a| a.touched_pages)
                    .sum::<u64>()
                    * self.shared.page
            })
            .unwrap_or(0)
    }

    /// Export the live block at `ptr` for another process
    /// ([`crate::ipc`]): one shareable handle of `kind` per page under it
    /// (`cuMemExportToShareableHandle` each; the pool must create its pages
    /// with that handle type, [`quilt_pool::PoolConfig::create_props`]), and
    /// the descriptor: the pages as pieces, in address order, and where the
    /// block lies in them. Until as many [`QuiltAllocator::end_export`]s as
    /// exports, the block is pinned: a `free` of it is deferred, so its
    /// pages stay mapped and are neither reclaimed nor reused.
    ///
    /// Errors, nothing changed: [`AllocError::UnknownPointer`] (not a live
    /// block, or one freed and waiting for its importers),
    /// [`AllocError::Sharing`] (a block of a tag, or more pages than one
    /// message carries, [`crate::ipc::MAX_PIECES`]), [`AllocError::Driver`] (a handle the
    /// driver cannot export as `kind`).
    pub fn export(
        &self,
        ptr: DevicePtr,
        kind: HandleKind,
    ) -> Result<ExportedAllocation, AllocError> {
        self.with(|l, ctx| {
            let tags = &l.tags;
            l.exports
                .export(&l.core, ctx, ptr, kind, |t| tags.name(t).to_string())
        })
    }

    /// One importer of the block exported at `ptr` has released it (its
    /// release message, or its process gone). When none is left, the block
    /// is unpinned, and freed now if its owner freed it meanwhile.
    /// [`AllocError::Sharing`] when no export of `ptr` is outstanding.
    pub fn end_export(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.with(|l, ctx| l.exports.end_export(&mut l.core, ctx, ptr))
    }

    /// Exports outstanding (imports other processes may still hold), in total.
    pub fn exports_outstanding(&self) -> u64 {
        self.shared
            .lock()
            .map(|l| l.state.exports.outstanding())
            .unwrap_or(0)
    }
}

impl DeviceAllocator for QuiltAllocator {
    fn name(&self) -> &str {
        self.shared.name
    }

    fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.with(|l, ctx| {
            with_offload_tier(l.tier(), ctx, None, |t, ctx| {
                t.core.allocate(ctx, size, stream)
            })
        })
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.with(|l, ctx| {
            if l.exports.defers_free(ptr)? {
                return Ok(()); // exported: freed at the last `end_export`
            }
            l.core.free(ctx, ptr)
        })
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        self.with(|l, _| {
            l.exports.check_not_freed(ptr)?;
            l.core.record_stream(ptr, stream)
        })
    }

    fn forget_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        QuiltAllocator::forget_stream(self, stream)
    }

    fn empty_cache(&self) -> Result<(), AllocError> {
        self.with(|l, ctx| l.core.empty_cache(ctx))
    }

    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        self.with(|l, ctx| {
            l.core.sync_stats(ctx);
            l.core.stats.reset_peaks();
            Ok(())
        })
    }

    fn stats(&self) -> AllocatorStats {
        let mut s = self
            .with(|l, ctx| {
                l.core.sync_stats(ctx);
                Ok(l.core.stats.clone())
            })
            .unwrap_or_default();
        s.driver = self.shared.vmm.driver_stats();
        s
    }

    fn snapshot(&self) -> MemorySnapshot {
        match self.shared.lock() {
            Ok(l) => segments::snapshot(&l.state.core, self.shared.name, self.shared.page),
            Err(_) => MemorySnapshot {
                allocator: self.shared.name.to_string(),
                segments: Vec::new(),
            },
        }
    }

    fn gpu_segments(&self) -> MemorySnapshot {
        self.mapped_segments()
    }

    fn last_oom(&self) -> Option<crate::error::OomReport> {
        self.shared
            .lock()
            .ok()
            .and_then(|l| l.state.core.last_oom.clone())
    }

    #[cfg(feature = "invariants")]
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let l = self
            .shared
            .lock()
            .map_err(|e| InvariantViolation(e.to_string()))?;
        invariants::check(
            &l.state.core,
            &l.state.growables,
            &l.state.tags,
            &l.state.exports,
            &self.shared.pool,
            self.shared.page,
        )
    }

    fn vmm(&self) -> &Arc<dyn Vmm> {
        &self.shared.vmm
    }
}

impl Drop for QuiltAllocator {
    fn drop(&mut self) {
        self.ahead.stop();
        let page = self.shared.page;
        let mut guard = match self.shared.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        let state = &mut guard.state.core;
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
        state
            .streams
            .synchronize_all(self.shared.vmm.as_ref(), tick);
        state.streams.destroy_events(self.shared.vmm.as_ref());
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
                match self.shared.vmm.unmap(a.page_addr(p), page) {
                    Ok(()) if slot.retired => a.clear_retired(p),
                    Ok(()) => give.extend(a.set_unmapped(p)),
                    Err(e) => tracing::warn!(error = %e, "unmap at drop failed"),
                }
            }
            if let Err(e) = self.shared.vmm.address_free(a.base, a.size) {
                tracing::warn!(error = %e, "address free at drop failed");
            }
        }
        if let Err(e) = self.shared.pool.give_back(&give) {
            tracing::warn!(error = %e, "returning pages to the pool at drop failed");
        }
        if let Err(e) = self.shared.pool.trim(0) {
            tracing::warn!(error = %e, "releasing pages at drop failed");
        }
    }
}
