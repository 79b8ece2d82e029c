//! Quilt's policies: the default policy and the GMLake preset are two values
//! of [`QuiltConfig`], not two allocators.

use quilt_pool::{GrowthPolicy, MemoryLimit, PageSize, PoolConfig};
use quilt_vmm::DeviceSet;

use super::growable::{MapAhead, Recycle};
use super::offload::OffloadTier;

use crate::error::AllocError;

/// When cached pages (mapped, touched by no block) are unmapped and returned
/// to the pool *before* it grows. Whatever the policy, when the pool cannot
/// grow, cached pages are reclaimed (synchronising the streams whose work may
/// still use them) before a request is declared out of memory; before growth,
/// only pages whose freeing work is known complete are taken, so no policy
/// ever synchronises a stream while the device still has room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimPolicy {
    /// Grow first; reclaim only when the pool cannot grow (Quilt's default).
    /// Pages stay where a loop first mapped them, so a repeated sequence of
    /// sizes makes no driver call after its first pass; the price is the
    /// cached pages in holes too small for the requests that made the pool
    /// grow (see `docs/design.md`, "Calls against memory held").
    WhenFull,
    /// Before growing, reclaim pages cached for at least this many allocator
    /// operations.
    IdleFor(u64),
    /// Before growing, reclaim as many cached pages as are missing (those known
    /// complete): memory held tracks memory used as closely as possible, at
    /// the price of driver calls in every pass of a loop.
    Always,
    /// Before growing, reclaim the oldest cached pages while the cache holds
    /// more than this many thousandths of the pool: a bounded cache.
    CachedAbove(u64),
}

/// Configuration of a [`super::QuiltAllocator`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuiltConfig {
    /// The physical pool: page size, growth margin, memory limit.
    pub pool: PoolConfig,
    /// Requests up to this size (bytes) are small (PyTorch's boundary, 1 MiB):
    /// with `separate_small_arena` they go to an arena of their own.
    pub small_size: u64,
    /// One arena for every stream (true), or one per stream (false). In a
    /// shared arena a block may be placed where another stream freed one; the
    /// new block's stream then waits for the freeing stream's work
    /// (`cuStreamWaitEvent`, as `cudaMallocAsync` does) unless that work is
    /// known complete.
    pub shared_arena: bool,
    /// A separate arena for small requests (true), or small blocks in the
    /// same arena as large ones, filling the holes between them (false).
    pub separate_small_arena: bool,
    /// Virtual address space reserved per arena, as a multiple of the memory
    /// limit (address space is cheap; 8 by default: placement that prefers
    /// mapped gaps over the best fit spreads blocks, and a request must never
    /// fail for want of a free virtual range while pages are available).
    pub arena_va_factor: u64,
    /// One `cuMemSetAccess` per page mapped (true, GMLake) or one per newly
    /// mapped contiguous range (false, as PyTorch's expandable segments).
    pub access_per_map: bool,
    /// When cached pages are reclaimed before growing the pool.
    pub reclaim: ReclaimPolicy,
    /// Placement looks at up to this many best-fitting gaps and takes the
    /// first whose pages are all mapped and free of other streams' pending
    /// work, then one that needs only a wait, then the one needing the fewest
    /// new pages (1 = plain best fit).
    pub placement_candidates: usize,
    /// Large requests of at least this size are stitched from pages wherever they
    /// are; smaller large requests (above `small_size`) are served only from a
    /// cached block or from fresh pages past the arena's mapped tail
    /// (GMLake's `fragLimit`). 0: stitch every request (Quilt's default).
    pub stitch_threshold: u64,
    /// Below the stitch threshold, reuse a cached free block only if it is at most
    /// this many times the request (GMLake's `reuseLimit`; 0 = no limit).
    pub reuse_limit: u64,
    /// Other devices every mapping is made accessible from: each
    /// `cuMemSetAccess` names this device and these peers (one call, one
    /// access descriptor per device; `cuMemMap`ped memory is not covered by
    /// `cudaEnablePeerAccess`). Empty by default: this device only.
    pub peer_access: DeviceSet,
    /// Growable buffers: pages mapped ahead of each buffer's end, and by whom
    /// ([`MapAhead`]; `QuiltAllocator::set_map_ahead` changes it at run time).
    pub map_ahead: MapAhead,
    /// Growable buffers: released ranges kept whole for the next buffer
    /// ([`Recycle`]; off by default).
    pub recycle: Recycle,
    /// What happens when a request would run out of memory ([`OffloadTier`];
    /// off by default).
    pub offload_tier: OffloadTier,
}

impl Default for QuiltConfig {
    /// Quilt's policy: one arena shared by every stream, stitching every
    /// request, cached pages reclaimed only when the device is full (see
    /// [`ReclaimPolicy::WhenFull`]).
    fn default() -> Self {
        QuiltConfig {
            pool: PoolConfig::default(),
            small_size: 1 << 20,
            shared_arena: true,
            separate_small_arena: false,
            arena_va_factor: 8,
            access_per_map: false,
            reclaim: ReclaimPolicy::WhenFull,
            placement_candidates: 8,
            stitch_threshold: 0,
            reuse_limit: 0,
            peer_access: DeviceSet::EMPTY,
            map_ahead: MapAhead::default(),
            recycle: Recycle::default(),
            offload_tier: OffloadTier::Off,
        }
    }
}

impl QuiltConfig {
    /// GMLake (ASPLOS'24) as a configuration of Quilt's stitching policy: one
    /// 2 MiB handle per page created only when needed, mapped and access-set
    /// one page at a time, an arena per stream, stitching only requests of
    /// 512 MiB or more (`fragLimit`), reusing a cached block only up to 10x the
    /// request (`reuseLimit`). Below the threshold it behaves as a caching
    /// allocator over whole 2 MiB pages.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let gmlake = QuiltAllocator::new(vmm, QuiltConfig::gmlake())?;
    /// assert_eq!(gmlake.name(), "gmlake");
    /// assert_eq!(QuiltConfig::gmlake().stitch_threshold, 512 << 20);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gmlake() -> QuiltConfig {
        QuiltConfig {
            pool: PoolConfig {
                page_size: PageSize::Granularity,
                growth: GrowthPolicy::exact(),
                limit: MemoryLimit::Device,
                create_props: quilt_vmm::CreateProps::default(),
            },
            small_size: 1 << 20,
            shared_arena: false,
            separate_small_arena: true,
            arena_va_factor: 2,
            access_per_map: true,
            reclaim: ReclaimPolicy::WhenFull,
            placement_candidates: 1,
            stitch_threshold: 512 << 20,
            reuse_limit: 10,
            peer_access: DeviceSet::EMPTY,
            map_ahead: MapAhead::default(),
            recycle: Recycle::default(),
            offload_tier: OffloadTier::Off,
        }
    }

    /// Check that the configuration keeps Quilt's promises and sets no knob
    /// the rest ignores ([`QuiltAllocator::new`](super::QuiltAllocator::new)
    /// calls it): at least one placement candidate; virtual space of at least
    /// twice the memory limit per arena (placement that prefers mapped gaps
    /// spreads blocks, and a request must not fail for want of a virtual gap
    /// while pages are free); a bounded cache of at most 1000 thousandths; a
    /// reuse limit only with a stitch threshold.
    ///
    /// ```
    /// use quilt_alloc::quilt::QuiltConfig;
    ///
    /// assert!(QuiltConfig::default().validate().is_ok());
    /// let bad = QuiltConfig { placement_candidates: 0, ..QuiltConfig::default() };
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), AllocError> {
        let fail = |reason: &str| {
            Err(AllocError::InvalidConfig {
                reason: reason.to_string(),
            })
        };
        if self.placement_candidates == 0 {
            return fail("placement_candidates must be at least 1");
        }
        if self.arena_va_factor < 2 {
            return fail("arena_va_factor must be at least 2 (virtual space per arena, as a multiple of the memory limit)");
        }
        if let ReclaimPolicy::CachedAbove(pm) = self.reclaim {
            if pm > 1000 {
                return fail(
                    "ReclaimPolicy::CachedAbove takes thousandths of the pool: at most 1000",
                );
            }
        }
        if self.map_ahead.below_per_mille > 1000 {
            return fail("MapAhead::below_per_mille takes thousandths of the limit: at most 1000");
        }
        if self.reuse_limit > 0 && self.stitch_threshold == 0 {
            return fail("reuse_limit applies only with a stitch_threshold above 0");
        }
        Ok(())
    }

    /// The same configuration with a memory limit.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{MemoryLimit, QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let config = QuiltConfig::default().with_limit(MemoryLimit::Bytes(64 << 20));
    /// let alloc = QuiltAllocator::new(vmm, config)?;
    /// assert!(alloc.allocate(100 << 20, StreamId::DEFAULT).is_err(), "over the limit");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_limit(mut self, limit: MemoryLimit) -> QuiltConfig {
        self.pool.limit = limit;
        self
    }
}
