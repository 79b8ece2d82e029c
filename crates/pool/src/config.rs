//! The pool's policies: page size, growth ahead of demand and the memory limit.

use quilt_vmm::CreateProps;

/// How much the pool holds at most.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryLimit {
    /// The whole device.
    Device,
    /// At most this many bytes (rounded down to whole pages).
    Bytes(u64),
    /// At most this fraction of the device's total memory (clamped to 0..=1).
    Fraction(f64),
}

impl MemoryLimit {
    /// The limit in bytes on a device of `total` bytes.
    pub fn resolve(self, total: u64) -> u64 {
        match self {
            MemoryLimit::Device => total,
            MemoryLimit::Bytes(b) => b.min(total),
            MemoryLimit::Fraction(f) => {
                let f = if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) };
                (total as f64 * f) as u64
            }
        }
    }
}

/// The size of one page: one `cuMemCreate` handle, mapped whole at offset 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageSize {
    /// The driver's allocation granularity (2 MiB on current GPUs).
    Granularity,
    /// This many bytes: a multiple of the granularity (e.g. 20 MiB, the large
    /// page of PyTorch's expandable segments), for experiments.
    Bytes(u64),
}

impl PageSize {
    /// The page size in bytes at `granularity`, or `None` when it is not a
    /// non-zero multiple of the granularity.
    pub fn resolve(self, granularity: u64) -> Option<u64> {
        match self {
            PageSize::Granularity => (granularity > 0).then_some(granularity),
            PageSize::Bytes(b) => {
                (granularity > 0 && b > 0 && b.is_multiple_of(granularity)).then_some(b)
            }
        }
    }
}

/// How many pages the pool creates when it must grow by `needed` pages.
///
/// A growth creates `needed` pages plus a margin ahead of demand of
/// `held / ahead_divisor` pages (0 = no margin), the margin capped at
/// `max_margin_bytes`. The margin is proportional to what the pool holds, so
/// the memory it can waste is a bounded fraction of the total while the number
/// of growths grows only logarithmically with the peak. When the device
/// cannot create the margin, the pool creates exactly `needed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrowthPolicy {
    /// Margin ahead of demand: `held / ahead_divisor` pages; 0 disables it.
    pub ahead_divisor: u64,
    /// The largest margin in bytes.
    pub max_margin_bytes: u64,
}

impl Default for GrowthPolicy {
    /// A margin of 1/256 of what the pool holds (0.4 %), at most 1 GiB.
    fn default() -> Self {
        GrowthPolicy {
            ahead_divisor: 256,
            max_margin_bytes: 1 << 30,
        }
    }
}

impl GrowthPolicy {
    /// Exactly what is needed, never ahead (GMLake: one `cuMemCreate` per
    /// page, when a request needs it).
    pub fn exact() -> GrowthPolicy {
        GrowthPolicy {
            ahead_divisor: 0,
            max_margin_bytes: 0,
        }
    }

    /// Pages to create when `needed` pages are missing and the pool holds
    /// `held` pages of `page_size` bytes.
    pub fn pages_to_create(&self, needed: u64, held: u64, page_size: u64) -> u64 {
        let margin = held
            .checked_div(self.ahead_divisor)
            .unwrap_or(0)
            .min(self.max_margin_bytes / page_size.max(1));
        needed.saturating_add(margin)
    }
}

/// The pool's configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolConfig {
    /// The size of a page (one handle).
    pub page_size: PageSize,
    /// How much to create when growing.
    pub growth: GrowthPolicy,
    /// The most the pool holds.
    pub limit: MemoryLimit,
    /// What each page's `cuMemCreate` requests beyond its size: the handle
    /// types it can be exported as and GPUDirect RDMA (none by default: a
    /// plain [`quilt_vmm::Vmm::create`]). Pages of a pool that requests POSIX
    /// file descriptors can be shared with another process.
    pub create_props: CreateProps,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            page_size: PageSize::Granularity,
            growth: GrowthPolicy::default(),
            limit: MemoryLimit::Device,
            create_props: CreateProps::default(),
        }
    }
}
