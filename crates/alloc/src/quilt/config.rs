//! Quilt's policies, every one a knob: the default policy and the GMLake preset
//! are two values of [`QuiltConfig`], not two allocators.

use quilt_pool::{GrowthPolicy, MemoryLimit, PoolConfig};

/// When cached pages (mapped behind free virtual space) are taken apart to back
/// a new block instead of growing the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimPolicy {
    /// Grow the pool first; reclaim cached pages only when the pool cannot grow
    /// (memory limit or device full). A repeated sequence of sizes then makes no
    /// driver call after its first pass, whatever the sequence.
    WhenFull,
    /// Before growing, reclaim the cached pages of mappings whose cached pages
    /// have not changed for at least this many allocator operations (a cold
    /// cache), then grow, then reclaim the rest when the pool cannot grow.
    IdleFor(u64),
    /// Reclaim every cached page before growing: memory held tracks memory used
    /// as closely as possible, at the price of driver calls.
    Always,
    /// Before growing, reclaim the oldest cached pages while the cache holds
    /// more than this many thousandths of the pool: a bounded cache. The
    /// default, `CachedAbove(50)`, behaves as `WhenFull` on every training
    /// trace and workload measured (their cache stays under 5 %), and bounds
    /// what a serving workload's growing KV caches leave behind.
    CachedAbove(u64),
}

/// Configuration of a [`super::QuiltAllocator`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuiltConfig {
    /// The physical pool: chunk sizes and growth margin, memory limit.
    pub pool: PoolConfig,
    /// Requests up to this size (bytes) are small: they go to the small arena of
    /// their stream. PyTorch's boundary, 1 MiB.
    pub small_size: u64,
    /// One arena for every stream (true), or one per stream (false). In a
    /// shared arena a block may be placed where another stream freed one; the
    /// new block's stream then waits for the freeing stream's work
    /// (`cuStreamWaitEvent`, as `cudaMallocAsync` does): memory freed on one
    /// stream serves the others without any driver call.
    pub shared_arena: bool,
    /// A separate arena per stream for small requests (true), or one arena per
    /// stream for every size (false: small blocks fill the holes between large
    /// ones, which measured better on the real traces; see `docs/design.md`).
    pub separate_small_arena: bool,
    /// When a block extends its arena's mapped tail, map the pool's free margin
    /// (up to the growth policy's ahead-of-demand margin) behind it in the same
    /// call, so the blocks that follow find their pages mapped.
    pub map_ahead: bool,
    /// Virtual address space reserved per arena, as a multiple of the memory
    /// limit (address space is cheap; 2 by default).
    pub arena_va_factor: u64,
    /// At most this many pages per `cuMemMap` call (0 = a whole run of
    /// neighbouring pages inside one chunk in one call).
    pub max_pages_per_map: u64,
    /// One `cuMemSetAccess` per map call (true, GMLake) or one per newly mapped
    /// contiguous range (false).
    pub access_per_map: bool,
    /// When cached pages are reclaimed instead of growing the pool.
    pub reclaim: ReclaimPolicy,
    /// Large requests of at least this size are stitched from pages wherever they
    /// are; smaller large requests (above `small_size`) are served only from a
    /// cached block of the same stream or from fresh pages rounded to whole pages
    /// (GMLake's `fragLimit`). 0: stitch every large request (Quilt's default).
    pub stitch_threshold: u64,
    /// Below the stitch threshold, reuse a cached free block only if it is at most
    /// this many times the request (GMLake's `reuseLimit`; 0 = no limit).
    pub reuse_limit: u64,
    /// Call `cuStreamSynchronize` on a stream before unmapping pages of its arena
    /// (as PyTorch's expandable segments do; safe on real GPUs, costs a sync).
    pub synchronize_before_unmap: bool,
    /// Placement prefers a gap whose pages are all mapped (cached), looking at
    /// up to this many best-fitting candidates, before the best-fitting gap
    /// regardless of mapping (0 = placement never looks at mappings).
    pub prefer_mapped_tries: usize,
    /// Reclaim the cached pages of a mapping that also backs live blocks, by
    /// unmapping it whole and mapping its live pages again (true), or never
    /// touch such a mapping (false). The remap is unsafe on a GPU while other
    /// host threads launch work on those blocks (see
    /// [`QuiltConfig::remap_live`]); the default is false, with single-owner
    /// runs so that every cached page stays reclaimable.
    pub remap_live_pages: bool,
    /// Keep every mapping of more than one page single-owner: all its pages lie
    /// wholly inside one occupied block, or no block touches any of them. A
    /// block's partly covered first and last pages are one-page mappings; a
    /// cached multi-page mapping that a new block would cover only in part is
    /// unmapped (no block touches it) and mapped again as pieces aligned to the
    /// block. Every cached page then stays reclaimable without ever unmapping a
    /// page under a live block, with whole runs mapped in one call.
    pub single_owner_runs: bool,
}

impl Default for QuiltConfig {
    /// The safe policy, [`QuiltConfig::cuda_safe`]: no page under a live block is
    /// ever unmapped, so it is correct on a real GPU whatever threads launch work.
    fn default() -> Self {
        QuiltConfig::cuda_safe()
    }
}

impl QuiltConfig {
    /// GMLake (ASPLOS'24) as a configuration of Quilt's stitching policy: one
    /// 2 MiB handle per page (one `cuMemCreate` each), mapped and access-set one
    /// page at a time, stitching only requests of 512 MiB or more (`fragLimit`),
    /// reusing a cached block only up to 10x the request (`reuseLimit`). Below
    /// the threshold it behaves as a caching allocator over whole 2 MiB pages.
    pub fn gmlake() -> QuiltConfig {
        QuiltConfig {
            pool: PoolConfig {
                growth: GrowthPolicy::page_per_chunk(),
                limit: MemoryLimit::Device,
            },
            max_pages_per_map: 1,
            access_per_map: true,
            shared_arena: false,
            separate_small_arena: true,
            map_ahead: false,
            reclaim: ReclaimPolicy::WhenFull,
            stitch_threshold: 512 << 20,
            reuse_limit: 10,
            ..QuiltConfig::remap_live()
        }
    }

    /// The default policy: safe on a real GPU. Runs of pages are mapped in one
    /// `cuMemMap`, but every mapping of more than one page is single-owner
    /// ([`QuiltConfig::single_owner_runs`]): a block's partly covered first and
    /// last pages are one-page mappings, and a cached multi-page mapping is
    /// split (unmapped, mapped again in pieces) before a block covers part of
    /// it. So reclaiming cached pages never unmaps a page under a live block,
    /// every cached page is reclaimable, and the streams are synchronised
    /// before pages are unmapped (as PyTorch's expandable segments do). No
    /// map-ahead: pages mapped ahead would form cached runs that the next
    /// blocks split again (an unmap and more maps), which measured costlier
    /// than mapping each block's own pages. The central promise holds.
    pub fn cuda_safe() -> QuiltConfig {
        QuiltConfig {
            max_pages_per_map: 0,
            remap_live_pages: false,
            single_owner_runs: true,
            map_ahead: false,
            synchronize_before_unmap: true,
            ..QuiltConfig::remap_live()
        }
    }

    /// Fewer driver calls, for programs that launch GPU work from one host
    /// thread: a whole run of neighbouring pages inside a chunk is one
    /// `cuMemMap`, and under memory pressure the cached pages of a mapping that
    /// also backs live blocks are reclaimed by unmapping it whole and mapping
    /// its live pages again (same physical pages, same addresses) after every
    /// stream is synchronised. Work launched from another host thread during
    /// that allocator call would fault on the briefly unmapped pages (the host
    /// backend's multi-threaded stress test shows it), hence not the default.
    pub fn remap_live() -> QuiltConfig {
        QuiltConfig {
            pool: PoolConfig {
                growth: GrowthPolicy::default(),
                limit: MemoryLimit::Device,
            },
            small_size: 1 << 20,
            shared_arena: true,
            separate_small_arena: false,
            map_ahead: true,
            arena_va_factor: 2,
            max_pages_per_map: 0,
            access_per_map: false,
            reclaim: ReclaimPolicy::CachedAbove(50),
            stitch_threshold: 0,
            reuse_limit: 0,
            synchronize_before_unmap: true,
            remap_live_pages: true,
            single_owner_runs: false,
            prefer_mapped_tries: 0,
        }
    }

    /// The same configuration with a memory limit.
    pub fn with_limit(mut self, limit: MemoryLimit) -> QuiltConfig {
        self.pool.limit = limit;
        self
    }
}
