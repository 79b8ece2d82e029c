//! Quilt's policy as types: one value per axis of the design (where a block
//! goes, how arenas are laid out, how access is set, when the cache is
//! reclaimed), with the serving policies and the physical pool beside them.
//! The default policy and the GMLake preset are two values of
//! [`QuiltConfig`], each written whole and carrying its own name, not two
//! allocators.

use quilt_pool::{GrowthPolicy, MemoryLimit, PageSize, PoolConfig};
use quilt_vmm::DeviceSet;

use crate::error::AllocError;

/// Where a block goes in its arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Quilt: every request is stitched from pages wherever they are. Among
    /// up to `candidates` best-fitting gaps, the first whose pages are all
    /// mapped and free of other streams' pending work, then one that needs
    /// only a wait, then the one needing the fewest new pages (1 = plain best
    /// fit); the block goes at the gap's start. Under memory pressure (the
    /// pool could not grow at its last try) the place touching the fewest
    /// untouched pages, at either end of a candidate gap: packing, not
    /// mapped pages, then decides what fits.
    BestFit {
        /// Best-fitting gaps looked at (at least 1).
        candidates: usize,
    },
    /// GMLake's limits (ASPLOS'24). A request in the large arena of at least
    /// `frag_limit` bytes (`fragLimit`) reuses a cached range of at most
    /// `reuse_limit` times its size (`reuseLimit`; 0: no limit), else is
    /// stitched into the best-fitting gap; a smaller one is served only from
    /// a cached range whose pages are all mapped or from fresh pages past
    /// the arena's mapped tail (no stitching, no promise: it may fail while
    /// pages are free). Blocks in the small arena and tagged blocks go to the
    /// best-fitting gap.
    GmlakeLimits {
        /// Requests of at least this many bytes are stitched (above 0:
        /// [`Placement::BestFit`] stitches every request).
        frag_limit: u64,
        /// At or above `frag_limit`, a cached range is reused only if it is
        /// at most this many times the request (0: no limit).
        reuse_limit: u64,
    },
}

impl Placement {
    /// Best-fitting gaps placement looks at where it chooses among them
    /// (under [`Placement::GmlakeLimits`], only for the blocks its limits do
    /// not govern: plain best fit).
    pub fn candidates(&self) -> usize {
        match *self {
            Placement::BestFit { candidates } => candidates,
            Placement::GmlakeLimits { .. } => 1,
        }
    }
}

/// Which streams share an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaSharing {
    /// One arena for every stream. A block may be placed where another stream
    /// freed one; the new block's stream then waits for the freeing stream's
    /// work (`cuStreamWaitEvent`, as `cudaMallocAsync` does) unless that work
    /// is known complete.
    Shared,
    /// One arena per stream: a stream only ever reuses its own frees.
    PerStream,
}

/// Where small requests go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SmallBlocks {
    /// In the same arena as large ones, filling the holes between them.
    Mixed,
    /// Requests of at most `up_to` bytes in an arena of their own (per
    /// [`ArenaSharing`]), as PyTorch's small pool.
    Separate {
        /// The largest small request, in bytes (above 0).
        up_to: u64,
    },
}

impl SmallBlocks {
    /// PyTorch's boundary between small and large requests: 1 MiB.
    pub const PYTORCH: SmallBlocks = SmallBlocks::Separate { up_to: 1 << 20 };

    /// True when a request of `size` bytes goes to the small arena.
    pub fn is_small(&self, size: u64) -> bool {
        match *self {
            SmallBlocks::Mixed => false,
            SmallBlocks::Separate { up_to } => size <= up_to,
        }
    }
}

/// How the virtual arenas are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaLayout {
    /// Which streams share an arena.
    pub sharing: ArenaSharing,
    /// Where small requests go.
    pub small: SmallBlocks,
    /// Virtual address space reserved per arena, as a multiple of the
    /// device's total memory (at least 2; sized from the device, not the
    /// memory limit, so that a limit raised at run time needs no new
    /// reservation; address space is cheap: placement that prefers
    /// mapped gaps spreads blocks, and a request must never fail for want of
    /// a free virtual range while pages are available).
    pub va_factor: u64,
}

/// How many `cuMemSetAccess` calls a mapping costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessGranularity {
    /// One per newly mapped contiguous range (as PyTorch's expandable
    /// segments).
    PerRange,
    /// One per page mapped (GMLake).
    PerPage,
}

/// When cached pages (mapped, touched by no block) are unmapped and returned
/// to the pool *before* it grows. Whatever the policy, when the pool cannot
/// grow, cached pages are reclaimed before a request is declared out of
/// memory, without a synchronisation: a page whose freeing work is known
/// complete is unmapped, any other retired (its pool page moves on carrying
/// that work as a hazard, its unmap waits for the work); before growth, only
/// pages whose freeing work is known complete are taken. No policy
/// synchronises a stream while the device still has room.
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

/// Configuration of a [`super::QuiltAllocator`]: one value per axis of the
/// policy. Presets are written whole: [`QuiltConfig::default`] (`quilt`) and
/// [`QuiltConfig::gmlake`]; [`QuiltConfig::validate`] refuses a combination
/// that would break a promise.
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::quilt::{MemoryLimit, QuiltAllocator, QuiltConfig, ReclaimPolicy};
/// use quilt_alloc::{settings, DeviceAllocator};
/// use quilt_vmm::{sim::SimVmm, Vmm};
///
/// // A preset with one axis changed, a memory limit and a name of its own.
/// let config = QuiltConfig { reclaim: ReclaimPolicy::Always, ..QuiltConfig::default() }
///     .with_limit(MemoryLimit::Fraction(0.5))
///     .named("quilt-lean");
/// // The same from text, as `QUILT_ALLOC_CONF` gives it (`settings::from_env`).
/// let parsed = settings::parse(QuiltConfig::default(), "reclaim:always,memory_fraction:0.5")?;
/// assert_eq!(parsed.named("quilt-lean"), config);
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
/// let alloc = QuiltAllocator::new(vmm, config)?; // validated first
/// assert_eq!(alloc.name(), "quilt-lean");
/// assert_eq!(alloc.pool_stats().limit_pages * alloc.pool_stats().page_size, 512 << 20);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuiltConfig {
    /// The name the allocator reports (`DeviceAllocator::name`, snapshots,
    /// out-of-memory reports): the preset's, or one given with
    /// [`QuiltConfig::named`]. Never derived from the other fields.
    pub name: &'static str,
    /// The physical pool: page size, growth margin, memory limit.
    pub pool: PoolConfig,
    /// Where a block goes in its arena.
    pub placement: Placement,
    /// Which streams share an arena, where small requests go, and the
    /// address space of each arena.
    pub layout: ArenaLayout,
    /// One `cuMemSetAccess` per page or per newly mapped range.
    pub access: AccessGranularity,
    /// When cached pages are reclaimed before growing the pool.
    pub reclaim: ReclaimPolicy,
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
    /// When events are recorded on a stream that frees memory another
    /// stream may reuse ([`EventTiming`]; on demand by default).
    pub events: EventTiming,
}

impl Default for QuiltConfig {
    /// Quilt's policy, named `quilt`: one arena shared by every stream, small
    /// and large blocks together, stitching every request (best fit among 8
    /// candidates), access set per range, cached pages reclaimed only when
    /// the device is full (see [`ReclaimPolicy::WhenFull`]).
    fn default() -> Self {
        QuiltConfig {
            name: "quilt",
            pool: PoolConfig::default(),
            placement: Placement::BestFit { candidates: 8 },
            layout: ArenaLayout {
                sharing: ArenaSharing::Shared,
                small: SmallBlocks::Mixed,
                va_factor: 8,
            },
            access: AccessGranularity::PerRange,
            reclaim: ReclaimPolicy::WhenFull,
            peer_access: DeviceSet::EMPTY,
            map_ahead: MapAhead::default(),
            recycle: Recycle::default(),
            offload_tier: OffloadTier::Off,
            events: EventTiming::OnDemand,
        }
    }
}

impl QuiltConfig {
    /// GMLake (ASPLOS'24) as a configuration of Quilt's stitching policy,
    /// named `gmlake`: one 2 MiB handle per page created only when needed,
    /// mapped and access-set one page at a time, an arena per stream with
    /// requests up to 1 MiB in one of their own, stitching only requests of
    /// 512 MiB or more (`fragLimit`), reusing a cached block only up to 10x
    /// the request (`reuseLimit`). Below the limit it behaves as a caching
    /// allocator over whole 2 MiB pages.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{Placement, QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let gmlake = QuiltAllocator::new(vmm, QuiltConfig::gmlake())?;
    /// assert_eq!(gmlake.name(), "gmlake");
    /// assert_eq!(
    ///     QuiltConfig::gmlake().placement,
    ///     Placement::GmlakeLimits { frag_limit: 512 << 20, reuse_limit: 10 }
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gmlake() -> QuiltConfig {
        QuiltConfig {
            name: "gmlake",
            pool: PoolConfig {
                page_size: PageSize::Granularity,
                growth: GrowthPolicy::exact(),
                limit: MemoryLimit::Device,
                create_props: quilt_vmm::CreateProps::default(),
            },
            placement: Placement::GmlakeLimits {
                frag_limit: 512 << 20,
                reuse_limit: 10,
            },
            layout: ArenaLayout {
                sharing: ArenaSharing::PerStream,
                small: SmallBlocks::PYTORCH,
                va_factor: 2,
            },
            access: AccessGranularity::PerPage,
            reclaim: ReclaimPolicy::WhenFull,
            peer_access: DeviceSet::EMPTY,
            map_ahead: MapAhead::default(),
            recycle: Recycle::default(),
            offload_tier: OffloadTier::Off,
            events: EventTiming::OnDemand,
        }
    }

    /// The same configuration under another name (what the allocator's
    /// `name()` then reports): a variant of a preset says what it is.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{Placement, QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let config = QuiltConfig {
    ///     placement: Placement::GmlakeLimits { frag_limit: 32 << 20, reuse_limit: 0 },
    ///     ..QuiltConfig::default()
    /// };
    /// let alloc = QuiltAllocator::new(vmm, config.named("quilt-limited"))?;
    /// assert_eq!(alloc.name(), "quilt-limited");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn named(mut self, name: &'static str) -> QuiltConfig {
        self.name = name;
        self
    }

    /// Check that the configuration keeps Quilt's promises and sets no value
    /// the rest ignores ([`QuiltAllocator::new`](super::QuiltAllocator::new)
    /// calls it): a name; at least one placement candidate; a fragment limit
    /// above 0; a small arena for some size; virtual space of at least twice
    /// the memory limit per arena (placement that prefers mapped gaps spreads
    /// blocks, and a request must not fail for want of a virtual gap while
    /// pages are free); a bounded cache and a map-ahead bound of at most 1000
    /// thousandths.
    ///
    /// ```
    /// use quilt_alloc::quilt::{Placement, QuiltConfig};
    ///
    /// assert!(QuiltConfig::default().validate().is_ok());
    /// let bad = QuiltConfig { placement: Placement::BestFit { candidates: 0 }, ..QuiltConfig::default() };
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), AllocError> {
        let fail = |reason: &str| {
            Err(AllocError::InvalidConfig {
                reason: reason.to_string(),
            })
        };
        if self.name.is_empty() {
            return fail("name must not be empty");
        }
        match self.placement {
            Placement::BestFit { candidates: 0 } => {
                return fail("Placement::BestFit needs candidates of at least 1");
            }
            Placement::GmlakeLimits { frag_limit: 0, .. } => {
                return fail(
                    "Placement::GmlakeLimits needs a frag_limit above 0 (Placement::BestFit stitches every request)",
                );
            }
            _ => {}
        }
        if self.layout.small == (SmallBlocks::Separate { up_to: 0 }) {
            return fail(
                "SmallBlocks::Separate needs up_to above 0 (SmallBlocks::Mixed keeps one arena)",
            );
        }
        if self.layout.va_factor < 2 {
            return fail("ArenaLayout::va_factor must be at least 2 (virtual space per arena, as a multiple of the device's memory)");
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

/// How many pages past its end a growable buffer keeps mapped ahead of its
/// growth, and who maps them.
///
/// A buffer keeps as many pages ahead as its last step reached (a growth
/// from a non-empty length: a KV cache's decode step, not its prompt),
/// `pages` before its first step, and never more than `pages`. They come
/// only from the pool's free pages (leaving one for each other live
/// buffer's next growth), or from growth while the pool holds less than
/// `below_per_mille` thousandths of its limit, and they are the
/// first cached pages reclaimed (before the pool grows, and before any
/// other cached page when it cannot). A shrink keeps as many of the pages
/// it leaves mapped, as if mapped ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapAhead {
    /// The most pages kept mapped past each buffer's end (0: none).
    pub pages: u64,
    /// Also grow the pool for pages ahead while it holds less than this many
    /// thousandths of its limit (0: only pages already free in the pool).
    pub below_per_mille: u64,
    /// Who maps them.
    pub mode: AheadMode,
}

/// Who maps the pages ahead of a growable buffer's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AheadMode {
    /// A worker thread of the allocator, woken after each growth.
    Background,
    /// The growing thread, at the end of each growth (deterministic).
    Inline,
    /// Only `QuiltAllocator::map_ahead_now` (deterministic; tests).
    Manual,
}

impl MapAhead {
    /// Nothing mapped ahead; a shrink keeps no spare page.
    pub const OFF: MapAhead = MapAhead {
        pages: 0,
        below_per_mille: 0,
        mode: AheadMode::Manual,
    };
}

impl Default for MapAhead {
    /// Each buffer's last step ahead, at most 8 pages (16 MiB at 2 MiB
    /// pages: the step of a 7B model's KV cache for 32 tokens), mapped in
    /// the background from pages the pool already holds free: mapping ahead
    /// is a bet on latency and never makes the pool grow (`below_per_mille`
    /// 0), so it adds no memory to what the buffers' growth needs.
    fn default() -> Self {
        MapAhead {
            pages: 8,
            below_per_mille: 0,
            mode: AheadMode::Background,
        }
    }
}

/// What happens to a released (untagged) growable buffer's range: kept
/// whole, its pages still mapped, for the next buffer created with the same
/// maximum (vAttention's deferred reclamation: a new request's KV cache
/// starts on mapped pages, no driver call), up to `max_buffers` of them; the
/// pages are spare pages meanwhile (reclaimed first, before the pool grows
/// once their work is known complete). Past the bound, or with a tag, the
/// range is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recycle {
    /// Released ranges kept at most (0: none).
    pub max_buffers: usize,
}

impl Recycle {
    /// Keep no released range.
    pub const OFF: Recycle = Recycle { max_buffers: 0 };
}

impl Default for Recycle {
    /// None kept: on `quilt-bench`'s `llm-serving-growable` keeping 64 saved
    /// 15 % of the driver calls but held 4.6 % more memory (pages kept
    /// mapped in released ranges while the pool grew), see
    /// `docs/serving.md`.
    fn default() -> Self {
        Recycle::OFF
    }
}

/// What happens when a request would run out of memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadTier {
    /// Nothing: the request fails with [`AllocError::OutOfMemory`].
    #[default]
    Off,
    /// Put awake offloadable tags to sleep (offload mode), those holding the
    /// most pages first, retrying the request after each, when the pages
    /// they hold with what is free, cached and creatable cover the request;
    /// never the tag the request is for.
    OffloadableTags,
}

/// When Quilt records an event on a stream whose freed memory another
/// stream may reuse (several streams sharing an arena): the trade between
/// event calls and waits that order more than they must.
///
/// An event tells when a stream's work up to its record has completed;
/// Quilt sees no kernel launch, so only an event recorded at a free covers
/// exactly the work that may still use the freed memory.
///
/// ```
/// use quilt_alloc::quilt::{EventTiming, QuiltConfig};
///
/// let exact = QuiltConfig { events: EventTiming::AtFree, ..QuiltConfig::default() };
/// assert_eq!(QuiltConfig::default().events, EventTiming::OnDemand);
/// # let _ = exact;
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventTiming {
    /// An event only when a decision needs one (placement over another
    /// stream's freed range, a wait, a reclaim): it covers the stream's work
    /// up to the decision, so on a busy stream a wait may order the reuse
    /// after more work than the free's (about one waiting allocation in
    /// ten on the multi-stream built-ins waits where the free's own work
    /// had completed). Few event calls: 0.09 to 0.13 records per operation
    /// on the `many-streams-N` workloads (see `docs/benchmarks.md`).
    #[default]
    OnDemand,
    /// An event at every free once several streams exist (what
    /// `cudaMallocAsync` keeps internally), a solo stream's frees included
    /// (see `solo.rs`: their hazards, built when the run ends, carry the
    /// frees' ticks): every wait orders a reuse after work that may still
    /// use the memory, and no wait is needless by the race finder on the
    /// multi-stream workloads and drawn traces (`benches/tests/waits.rs`);
    /// about 0.5 records (and as many capture questions) per operation
    /// once several streams exist (a second stream used once included).
    /// Two exceptions remain: frees one
    /// stream made before a second appeared record no event (a one-stream
    /// program pays none), and hazards built from the pages are per page,
    /// so the first reuses after those may wait needlessly (found by the
    /// ignored probe test of `tests/multistream_props.rs`, on generated
    /// loops where a second stream appears after the first one's frees).
    AtFree,
}

impl EventTiming {
    /// Events are recorded at frees.
    pub(crate) fn at_free(self) -> bool {
        self == EventTiming::AtFree
    }
}
